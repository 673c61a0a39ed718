"""Logits into tokens and tokens into text: the sampler (`sampler.py`), the decode step's argmax
(`argmax.py`), grammar masks (`grammar.py`) and their worker-process checks (`grammar_check.py`),
the incremental detokenizer (`detokenizer.py`)."""

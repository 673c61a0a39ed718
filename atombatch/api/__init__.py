"""The engine's vocabulary: request values (`structs.py`, `structured.py`), the rules a request is
checked by (`validation.py`), engine options (`options.py`) and policy (`policy.py`), what the
engine reports (`reports.py`) and the per-request mailbox of its outputs (`mailbox.py`)."""

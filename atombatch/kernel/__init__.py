"""The block/lane kernel: the compiled hot path (`_blocks.pyx`), its pure-Python twin
(`_blocks_py.py`), the codes both share (`codes.py`), the one place that picks between them
(`blocks.py`) and the prefix index over its digest table (`prefix.py`)."""

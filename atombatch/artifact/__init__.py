"""What the compiled graphs are: model specs and artifact shapes (`config.py`), optimum-rbln
compiled directories (`rbln_config.py`) and the device memory plan (`plan.py`)."""

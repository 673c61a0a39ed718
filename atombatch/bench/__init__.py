"""Benchmarks: `python -m atombatch.bench [micro|serve|fit] ...`.

- `micro`: the block/lane hot path, compiled vs pure-Python twin (`atombatch.bench.micro`).
- `serve`: the origin issue's serving matrix on the calibrated simulator, or on the NumPy runtime
  with small specs (`atombatch.bench.serve`).
- `fit`: the device-memory planner (`atombatch.bench.fit`).

Plain `python -m atombatch.bench` runs a short `micro` and a short `serve` and prints both.
"""

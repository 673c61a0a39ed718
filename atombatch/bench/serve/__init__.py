"""`python -m atombatch.bench serve`: the origin issue's serving matrix on the simulator.

Every cell runs a real `Batcher` (the scheduler that will drive the device) on a `SimRuntime` whose
virtual clock is advanced by a `CostModel` calibrated to the origin issue's KONI B1/k1 figures:

    python -m atombatch.bench serve                         # 4 models x 3 routes x 4 inputs x 2
                                                            # outputs x B1/k1,B1/k3,B1/k5,B4/k5,
                                                            # B4/k5/dbs1,2,4 (buckets), c16
    python -m atombatch.bench serve --models koni-8b --inputs 8192 --outputs 128 \\
        --artifacts B1/k1,B4/k5 --ignore-fit --json koni.json

Cells (model x route x input x output x artifact x policy) report TTFT p50/p99/max and completion
p50/max of the requests that finished within the timeout (requests over it count as failures and are
kept out of the latency figures), aggregate output tok/s, the histogram of decoding lanes per decode
step, device time by kind (prefill, PD import, decode), the artifact identity and its `plan.fit`
verdict. An artifact that does
not fit the device is reported and not run (`--ignore-fit` runs it anyway, marked as such).

Load: `--concurrency` clients (default 16) each send one request, then the next when the previous
one finishes (`--requests` in total, default one per client), all starting together as in the
origin; `--arrivals poisson --rate R` submits open-loop Poisson arrivals instead.

PD routes ("pd-whole", "pd-layer-stream") run the engine's real consumer path: each request is
submitted with `kv=` a `SimKVSource` from one `SimProducer` (a serial producer; see
`atombatch.runtime.sim`), so the decoder runs "import" steps instead of prefill chunks. When every
request waits on the producer and the Batcher has nothing to run, the virtual clock jumps to the
producer's next header or layer.

`--runtime numpy` runs the same harness on `NumpyRuntime.random` with small specs of the same
families and real wall time (native route only): a B4/B1 ratio measured on real compute.

Modules: `records` (the result Structs written as JSON), `matrix` (the load, one cell, the
matrix), `report` (the tables and the plot), `cli` (the command line).
"""

from __future__ import annotations

from atombatch.bench.serve.cli import _parser, main
from atombatch.bench.serve.matrix import (
    ARTIFACTS,
    CHUNK,
    CONCURRENCY,
    CONTEXT,
    INPUTS,
    MODELS,
    NUMPY_CHUNK,
    NUMPY_CONTEXT,
    NUMPY_INPUTS,
    NUMPY_OUTPUTS,
    OBSERVED_MODEL,
    OBSERVED_USED_BYTES,
    OUTPUTS,
    POLICIES,
    TIMEOUT_S,
    Load,
    fit_verdict,
    parse_artifact,
    run,
    run_cell,
    small_spec,
)
from atombatch.bench.serve.records import (
    Cell,
    FitVerdict,
    Latency,
    Machine,
    RequestRecord,
    ServeReport,
)
from atombatch.bench.serve.report import (
    format_bucket_comparison,
    format_comparison,
    format_table,
    write_plot,
)

__all__ = [
    "ARTIFACTS",
    "CHUNK",
    "CONCURRENCY",
    "CONTEXT",
    "INPUTS",
    "MODELS",
    "NUMPY_CHUNK",
    "NUMPY_CONTEXT",
    "NUMPY_INPUTS",
    "NUMPY_OUTPUTS",
    "OBSERVED_MODEL",
    "OBSERVED_USED_BYTES",
    "OUTPUTS",
    "POLICIES",
    "TIMEOUT_S",
    "Cell",
    "FitVerdict",
    "Latency",
    "Load",
    "Machine",
    "RequestRecord",
    "ServeReport",
    "_parser",
    "fit_verdict",
    "format_bucket_comparison",
    "format_comparison",
    "format_table",
    "main",
    "parse_artifact",
    "run",
    "run_cell",
    "small_spec",
    "write_plot",
]

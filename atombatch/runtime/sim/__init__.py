"""`SimRuntime`: a device-time model of a compiled ATOM artifact. No math, a virtual clock.

Theory of operation
-------------------
Every `prefill` / `decode` call advances a virtual clock by what a `CostModel` says the device would
take, and returns deterministic pseudo-logits. The `Batcher` picks the clock up (`runtime.clock`),
so every timestamp of a simulated run (arrival, first token, finish) is virtual: a c16 x 8192-token
matrix runs in seconds and says what B4 would do to queueing before anyone spends device time.

Modules: `costs` (the cost model, its calibration to observed figures, and the shapes it costs
from), `runtime` (`SimRuntime`, the virtual-clock `Runtime`), `producer` (the simulated PD
producer and its KV sources), `speculative` (the projected gain of speculative decoding).
"""

from __future__ import annotations

from atombatch.runtime.sim.costs import (
    ORIGIN_KONI_B1,
    PD_HEADERS,
    Calibration,
    CostModel,
    LoraCost,
    ObservedFigures,
    calibrate,
    fit_serial_times,
    lora_cost,
    origin_artifact,
    serial_figures,
)
from atombatch.runtime.sim.producer import PD_MODES, ROUTES, Route, SimKVSource, SimProducer
from atombatch.runtime.sim.runtime import DeviceTime, SimRuntime

__all__ = [
    "ORIGIN_KONI_B1",
    "PD_HEADERS",
    "PD_MODES",
    "ROUTES",
    "Calibration",
    "CostModel",
    "DeviceTime",
    "LoraCost",
    "ObservedFigures",
    "Route",
    "SimKVSource",
    "SimProducer",
    "SimRuntime",
    "calibrate",
    "fit_serial_times",
    "lora_cost",
    "origin_artifact",
    "serial_figures",
]

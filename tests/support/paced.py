"""A NumPy runtime whose decode takes at least `step_s` (a sleep, releasing the GIL as a device
wait does). The tiny test models step in well under a millisecond, far less than a round trip
through a server or the engine core's sockets on a loaded machine: a test that needs a request
to arrive while others still decode paces the decode, so its outcome does not depend on how
fast the machine's clients are that day."""

from __future__ import annotations

import time
from typing import Any

from atombatch.runtime import NumpyRuntime


class PacedDecode(NumpyRuntime):
    step_s = 0.02

    def decode(self, inputs: Any, **kwargs: Any) -> Any:  # (lora_int_ids=, with adapters)
        time.sleep(self.step_s)
        return super().decode(inputs, **kwargs)

"""`SimProducer` and `SimKVSource`: prefill/decode disaggregation in simulated time.

Prefill/decode disaggregation (docs/pd.md) runs on the engine's real consumer path. A `SimProducer`
(an RNGD or another ATOM) prefills prompts one at a time in arrival order, each in the decoder
artifact's native prefill time divided by `producer_speed`, layer by layer (an equal share per
layer), and sends each layer's K/V over one serial link at `transfer_bandwidth`. Every request gets
a `SimKVSource` (`Batcher.submit(..., kv=source)`) whose `poll` hands out what has arrived by the
engine's virtual clock:

* "whole": after the producer's prefill, all layers cross the link back to back; the header and
  every layer are handed out together when the last byte is in (as the in-process and ZeroMQ
  sources do in "whole" mode).
* "layer-stream": layer i crosses as soon as the producer's compute for it is done and the link is
  free (transfer overlapped with compute). The header carries the producer's first token, which
  exists only after its last layer, so by default (`pd_header="first-token"`) the header, and with
  it admission, comes when the producer's prefill ends; layers that crossed earlier are handed out
  with it. `pd_header="producer-start"` is the what-if of a protocol that sends the header when the
  producer starts and the first token later (the current `KVHeader` cannot: a full-prefix header
  must carry `first_token`); the request then holds a lane or the spare while its layers stream in.

The engine validates the header and each layer and plans "import" steps; each `write_layer_kv`
advances the decoder's clock by `import_call_s` plus the layer's K/V bytes (per device, in the
artifact's `kv_dtype`) at `import_bandwidth`. The sources' K/V are zero-stride float32 arrays of
the header's shapes (nothing is allocated per layer, and `LayerKV.float32()` passes float32 through
without a copy); link and import costs are charged in the artifact's `kv_dtype`, what a real
producer would send. The producer's first token follows the same pseudo-logits rule as this
`SimRuntime`'s last prefill chunk, so greedy PD output equals native output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

from atombatch.api.structs import SamplingParams
from atombatch.errors import ConfigError, KVTransferError
from atombatch.pd.wire import KVHeader, LayerKV, Mode, expected_layer_tokens, model_identity
from atombatch.runtime.sim.runtime import SimRuntime
from atombatch.sampling.sampler import sample

Route = Literal["native", "pd-whole", "pd-layer-stream"]
ROUTES: tuple[str, ...] = ("native", "pd-whole", "pd-layer-stream")
#: The producer's pacing for each PD route.
PD_MODES: dict[str, Mode] = {"pd-whole": "whole", "pd-layer-stream": "layer-stream"}


class SimKVSource:
    """A `KVSource` whose header and layers become available at fixed virtual times.

    `poll` compares the times with `clock` (the decoder's virtual clock) and hands out what has
    arrived; layers never come before the header. Built by `SimProducer.source`.
    """

    def __init__(self, header: KVHeader, header_at: float, layers: Sequence[LayerKV],
                 layer_at: Sequence[float], clock: Callable[[], float]) -> None:
        self.header = header
        self.header_at = header_at               # when the header reaches the decoder
        self.layers = list(layers)
        # a layer is handed out no earlier than the header
        self.layer_at = [max(t, header_at) for t in layer_at]
        self._clock = clock
        self._next = 0                            # first layer not yet handed out
        self._header_out = False
        self._closed = False

    @property
    def ready_at(self) -> float:
        """When the last layer has arrived."""
        return self.layer_at[-1] if self.layer_at else self.header_at

    def poll(self) -> tuple[KVHeader | None, list[LayerKV]]:
        if self._closed:
            raise KVTransferError(f"simulated KV source for {self.header.request_id} was closed")
        now = self._clock()
        if now < self.header_at:
            return None, []
        self._header_out = True
        first = self._next
        while self._next < len(self.layers) and self.layer_at[self._next] <= now:
            self._next += 1
        return self.header, self.layers[first:self._next]

    def done(self) -> bool:
        return self._header_out and self._next == len(self.layers)

    def close(self) -> None:
        self._closed = True

    def next_event(self) -> float | None:
        """When `poll` will next hand out something new; None when nothing is left (or closed)."""
        if self._closed:
            return None
        if not self._header_out:
            return self.header_at
        return self.layer_at[self._next] if self._next < len(self.layers) else None


class SimProducer:
    """A simulated PD producer feeding one `SimRuntime` decoder (see the module docstring).

    Prompts are prefilled one at a time in the order `source` is called; the producer's compute is
    `CostModel.producer_prefill_s` on the decoder's artifact, split equally over the layers, and
    its K/V cross one serial link at `transfer_bandwidth` (the link of one prompt overlaps the next
    prompt's compute). The first token is sampled, as `atombatch.pd.Producer` does, from the
    decoder's pseudo-logits for the prompt with `default_rng(params.seed)`: greedy output equals
    native output; sampled output does not (native prefill draws from the request's own RNG).

    Args:
        runtime: the decoder (its clock, cost model, artifact and pseudo-logits).
        mode: "whole" or "layer-stream".
    """

    def __init__(self, runtime: SimRuntime, mode: Mode = "layer-stream") -> None:
        if mode not in ("whole", "layer-stream"):
            raise ConfigError(f"mode={mode!r} is not whole or layer-stream")
        self.runtime = runtime
        self.mode = mode
        self.costs = runtime.costs
        self.artifact = runtime.artifact
        spec = self.artifact.model
        self._window = spec.sliding_window if spec.is_hybrid else 0
        self._identity = model_identity(spec)
        self._zero = np.zeros((), dtype=np.float32)
        self._arrays: dict[int, npt.NDArray[np.float32]] = {}
        self.free_at = 0.0          # the producer's compute is busy until then
        self.link_free_at = 0.0     # the link is busy until then
        self.busy_s = 0.0           # compute time over all prompts
        self.transfer_s = 0.0       # link time over all prompts
        self.requests = 0
        self.sources: list[SimKVSource] = []

    def _kv(self, tokens: int) -> npt.NDArray[np.float32]:
        """A read-only zero-stride float32 K (or V) of `tokens` tokens: no memory per layer."""
        array = self._arrays.get(tokens)
        if array is None:
            spec = self.artifact.model
            array = np.broadcast_to(self._zero, (spec.num_kv_heads, tokens, spec.head_dim))
            self._arrays[tokens] = array
        return array

    def source(self, request_id: str, prompt: Sequence[int] | npt.NDArray[np.integer],
               params: SamplingParams | None = None, arrival: float | None = None) -> SimKVSource:
        """Queue `prompt` on the producer (at `arrival`, default now); returns its KV source."""
        params = params or SamplingParams(temperature=0.0)  # no params: greedy
        spec, art, costs = self.artifact.model, self.artifact, self.costs
        n = len(prompt)
        now = self.runtime.clock() if arrival is None else arrival
        start = max(now, self.free_at)
        compute = costs.producer_prefill_s(art, n)
        end = start + compute
        self.free_at = end
        self.busy_s += compute
        self.requests += 1
        kinds = spec.layer_kinds
        tokens = expected_layer_tokens(kinds, n, self._window)
        layers = [LayerKV(i, self._kv(t), self._kv(t)) for i, t in enumerate(tokens)]
        link = self.link_free_at
        layer_at: list[float] = []
        per_layer = compute / len(kinds)
        for i, t in enumerate(tokens):
            computed = end if self.mode == "whole" else start + (i + 1) * per_layer
            transfer = costs.layer_transfer_s(art, t)
            link = max(link, computed) + transfer
            self.transfer_s += transfer
            layer_at.append(link)
        self.link_free_at = link
        if self.mode == "whole":
            header_at = link
            layer_at = [link] * len(layer_at)
        else:
            header_at = start if costs.pd_header == "producer-start" else end
        first = sample(self.runtime.prompt_logits(prompt), params,
                       np.random.default_rng(params.seed))
        header = KVHeader(
            request_id=request_id, model_identity=self._identity, num_layers=spec.num_layers,
            layer_kinds=kinds, prompt_len=n, covered_len=n, first_token=first, dtype="float32",
            kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, sliding_window=self._window,
            layer_tokens=tokens)
        source = SimKVSource(header, header_at, layers, layer_at, self.runtime.clock)
        self.sources.append(source)
        return source

    def next_event(self) -> float | None:
        """The earliest time any open source hands out something new (None: nothing pending)."""
        self.sources = [s for s in self.sources if s.next_event() is not None]
        return min((s.next_event() for s in self.sources), default=None)  # type: ignore[type-var]

"""PD intake: the engine's side of requests whose KV a producer sends (docs/pd.md).

`PDIntake` holds one `KVLink` per such request. It polls the sources, validates what they sent
against the artifact and writes the layers a plan imports; it returns what failed instead of
failing requests itself, so the engine stays the one place a request ends.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from atombatch.artifact.config import ArtifactConfig
from atombatch.engine.request import Request, StepPlan
from atombatch.errors import KVTransferError
from atombatch.logs import log
from atombatch.pd.source import KVSource


class KVLink:
    """The engine's side of one PD request: its source and what arrived so far."""

    __slots__ = ("arrived", "header", "last_progress", "lora", "opened", "seen", "source")

    def __init__(self, source: KVSource, now: float, lora: Any = None) -> None:
        self.source = source
        self.lora = lora                 # the request's LoRA adapter (the header must name it)
        self.opened = now
        self.header: Any = None
        self.arrived: list[Any] = []     # validated layers not yet written
        self.seen: set[int] = set()      # layer indices received
        self.last_progress = now


class PDIntake:
    """The KV links of a Batcher's PD requests, by request id.

    Args:
        artifact: what headers and layers are validated against.
        timeout: seconds a request may wait for its producer's next message (`pd_timeout`).
        deadline: seconds the whole import may take from submit (`pd_deadline`; None: twice
            `timeout`), so a producer that sends each message just in time holds a lane for a
            bounded time, not (layers + 1) x `timeout`.
    """

    def __init__(self, artifact: ArtifactConfig, timeout: float,
                 deadline: float | None = None) -> None:
        self.artifact = artifact
        self.spec = artifact.model
        self.timeout = timeout
        self._deadline = deadline
        self.links: dict[str, KVLink] = {}

    @property
    def deadline(self) -> float:
        return 2 * self.timeout if self._deadline is None else self._deadline

    @deadline.setter
    def deadline(self, seconds: float | None) -> None:
        self._deadline = seconds

    @property
    def require_full_prefix(self) -> bool:
        """The producer must send the KV of the whole prompt (single-block and hybrid models)."""
        return self.artifact.single_block or self.spec.is_hybrid

    def expect(self, source: KVSource, prompt: Any) -> None:
        """Let the source check the header on arrival, if it can."""
        expect = getattr(source, "expect", None)
        if expect is not None:
            expect(self.artifact, prompt, self.require_full_prefix)

    def open(self, request_id: str, source: KVSource, now: float, lora: Any = None) -> None:
        """Link a request to its source; `lora`: its `LoraAdapter` (None: the base model),
        whose identity the producer's header must carry."""
        self.links[request_id] = KVLink(source, now, lora)

    def poll(self, requests: Mapping[str, Request], now: float) -> list[tuple[Request, str]]:
        """Collect what producers sent and validate it; returns the requests whose source broke
        or stalled, with the message to fail each with. Links of requests that ended (finished,
        preempted or fully imported) are closed."""
        from atombatch.pd import checks as pdmod

        failed: list[tuple[Request, str]] = []
        for request_id, link in list(self.links.items()):
            request = requests.get(request_id)
            if request is None or request.pd is None:  # finished, preempted or fully imported
                self.close(request_id)
                continue
            progress = request.pd
            try:
                header, layers = link.source.poll()
                if header is not None and link.header is None:
                    lora = link.lora
                    pdmod.validate_header(header, self.artifact, request.prompt,
                                          require_full=self.require_full_prefix,
                                          lora_identity=lora.identity if lora else "",
                                          lora=lora.name if lora else None)
                    link.header = header
                    progress.header_ok = True
                    progress.covered_len = header.covered_len
                    progress.first_token = header.first_token
                    progress.num_layers = header.num_layers
                    link.last_progress = now
                if layers:
                    if link.header is None:
                        raise KVTransferError(f"request {request_id}: layers arrived "
                                              "before the header")
                    for layer in layers:
                        pdmod.validate_layer(link.header, layer, link.seen)
                        link.seen.add(layer.layer)
                    link.arrived.extend(layers)
                    link.last_progress = now
                if link.header is not None and link.source.done() and \
                        len(link.seen) != link.header.num_layers:
                    raise KVTransferError(
                        f"request {request_id}: the producer finished after "
                        f"{len(link.seen)} of {link.header.num_layers} layers")
                if not link.source.done() and now - link.last_progress > self.timeout:
                    raise KVTransferError(
                        f"request {request_id}: no KV from the producer for "
                        f"{now - link.last_progress:.1f} s (pd_timeout={self.timeout} s)")
                if not progress.complete and now - link.opened > self.deadline:
                    raise KVTransferError(
                        f"request {request_id}: the KV import did not complete within "
                        f"pd_deadline={self.deadline} s ({len(link.seen)} of "
                        f"{progress.num_layers or '?'} layers arrived)")
            except Exception as exc:
                failed.append((request, f"KV import failed: {exc}"))
                continue
            progress.pending = len(self.writable(link))
        return failed

    def writable(self, link: KVLink) -> list[Any]:
        """Layers that may be written now. A hybrid model's sliding layers wait for the whole
        payload, so no decode step (which writes every lane's slot) falls between their writes."""
        if not self.spec.is_hybrid or link.header is None:
            return link.arrived
        if len(link.seen) == link.header.num_layers:
            return link.arrived
        kinds = self.spec.layer_kinds
        return [layer for layer in link.arrived if kinds[layer.layer] != "sliding_attention"]

    def write(self, link: KVLink, plan: StepPlan, runtime: Any) -> int:
        """Write the link's writable layers into the plan's blocks (and sliding slot); returns
        how many. A runtime failure propagates, with the link unchanged."""
        layers = self.writable(link)
        for layer in layers:
            k, v = layer.float32()
            runtime.write_layer_kv(layer.layer, k, v, plan.blocks, plan.slot)
        written = {id(layer) for layer in layers}
        link.arrived = [layer for layer in link.arrived if id(layer) not in written]
        return len(layers)

    def close(self, request_id: str) -> None:
        link = self.links.pop(request_id, None)
        if link is not None:
            try:
                link.source.close()
            except Exception as exc:  # a broken transport must not take the engine down
                log.warning("kv.close_failed", request_id=request_id, error=str(exc))

"""How prefill chunks and decode steps interleave (`Policy`)."""

from __future__ import annotations

import msgspec

from atombatch.errors import ConfigError

POLICY_KINDS = ("prefill-first", "decode-first", "interleave", "fill-first", "stall-free")
# The engine's default: prefill-first, but while lanes decode a decode step runs at least every
# 8 prefill chunks, so one long prompt (or a batch of them) never freezes the streams
# (docs/results.md measures it beside prefill-first).
DEFAULT_POLICY = "stall-free:8"


class Policy(msgspec.Struct, frozen=True):
    """How prefill chunks and decode steps interleave.

    `kind`: "prefill-first" (any pending prefill chunk runs before the next decode step),
    "decode-first" (prefill only when no lane decodes), "interleave" (at most one prefill chunk
    per `decode_steps` decode steps while lanes decode; idle devices always prefill), or
    "fill-first" (a lane's own prefill runs at once, so lanes fill up; chunks into the spare,
    which only shorten a future request's wait, run one per `decode_steps` decode steps), or
    "stall-free" (prefill-first, but while lanes decode at most `prefill_chunks` prefill chunks
    run between two decode steps: the longest pause of a decoding stream is that many chunks,
    as in Sarathi-Serve's stall-free batching; a hybrid lane's own prefill and KV imports are
    never cut, see `Scheduler._prefill_turn`).
    """

    kind: str = "prefill-first"
    decode_steps: int = 4
    prefill_chunks: int = 4

    def __post_init__(self) -> None:
        if self.kind not in POLICY_KINDS:
            raise ConfigError(f"policy kind={self.kind!r} is not one of {', '.join(POLICY_KINDS)}")
        if self.decode_steps < 1:
            raise ConfigError(f"decode_steps={self.decode_steps} must be >= 1")
        if self.prefill_chunks < 1:
            raise ConfigError(f"prefill_chunks={self.prefill_chunks} must be >= 1")

    @classmethod
    def parse(cls, text: str | Policy) -> Policy:
        """`"prefill-first"`, `"decode-first"`, `"interleave[:N]"`, `"fill-first[:N]"` or
        `"stall-free[:K]"`."""
        if isinstance(text, Policy):
            return text
        kind, _, n = text.partition(":")
        try:
            value = int(n) if n else 4
        except ValueError:
            raise ConfigError(f"policy {text!r}: {n!r} is not an integer") from None
        if kind == "stall-free":
            return cls(kind=kind, prefill_chunks=value)
        return cls(kind=kind, decode_steps=value)

    @property
    def label(self) -> str:
        if self.kind in ("interleave", "fill-first"):
            return f"{self.kind}:{self.decode_steps}"
        if self.kind == "stall-free":
            return f"{self.kind}:{self.prefill_chunks}"
        return self.kind

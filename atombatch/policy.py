"""How prefill chunks and decode steps interleave (`Policy`)."""

from __future__ import annotations

import msgspec

from atombatch.errors import ConfigError

POLICY_KINDS = ("prefill-first", "decode-first", "interleave", "fill-first")


class Policy(msgspec.Struct, frozen=True):
    """How prefill chunks and decode steps interleave.

    `kind`: "prefill-first" (any pending prefill chunk runs before the next decode step),
    "decode-first" (prefill only when no lane decodes), "interleave" (at most one prefill chunk
    per `decode_steps` decode steps while lanes decode; idle devices always prefill), or
    "fill-first" (a lane's own prefill runs at once, so lanes fill up; chunks into the spare,
    which only shorten a future request's wait, run one per `decode_steps` decode steps).
    """

    kind: str = "prefill-first"
    decode_steps: int = 4

    def __post_init__(self) -> None:
        if self.kind not in POLICY_KINDS:
            raise ConfigError(f"policy kind={self.kind!r} is not one of {', '.join(POLICY_KINDS)}")
        if self.decode_steps < 1:
            raise ConfigError(f"decode_steps={self.decode_steps} must be >= 1")

    @classmethod
    def parse(cls, text: str | Policy) -> Policy:
        """`"prefill-first"`, `"decode-first"`, `"interleave"` or `"interleave:N"`."""
        if isinstance(text, Policy):
            return text
        kind, _, n = text.partition(":")
        return cls(kind=kind, decode_steps=int(n) if n else 4)

    @property
    def label(self) -> str:
        if self.kind in ("interleave", "fill-first"):
            return f"{self.kind}:{self.decode_steps}"
        return self.kind

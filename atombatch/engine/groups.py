"""The parent of an `n > 1` request (vLLM's `ParentRequest`): its choices, which of them wait for
choice 0's prefill, and what to do with them next.

A `Group` decides and hands back values (the next move, the choices to queue, the choice that
takes over the prompt logprobs, whether the request is finished); the engine runs the device
copies, samples and queues.
"""

from __future__ import annotations

import enum

import msgspec
import numpy as np
import numpy.typing as npt

from atombatch.api.structs import SamplingParams, TokenLogprobs
from atombatch.engine.request import Request, RequestState


class Move(enum.Enum):
    """What the held choices of a group do now (`Group.next_move`)."""

    WAIT = "wait"    # choice 0 has no first token yet (and has not ended)
    FORK = "fork"    # start them on idle lanes from device copies of choice 0's prompt KV
    SHARE = "share"  # publish choice 0's prompt blocks in the prefix cache, then queue them
    QUEUE = "queue"  # queue them: each prefills on its own


class Group:
    """The choices of one request with n > 1."""

    __slots__ = ("first_row", "held", "live", "members", "prompt_logprobs", "prompt_result")

    def __init__(self, prompt_logprobs: int | None = None) -> None:
        self.members: list[Request] = []     # every choice, index order
        self.held: list[Request] = []        # choices waiting for choice 0's prefill
        self.live = 0                        # choices not finished yet
        self.first_row: npt.NDArray[np.float32] | None = None  # choice 0's first-token logits,
                                             #   kept while choices wait to fork from it
        self.prompt_logprobs = prompt_logprobs   # the request's prompt_logprobs (choice 0 asks)
        self.prompt_result: tuple[TokenLogprobs | None, ...] | None = None  # once computed

    @staticmethod
    def child_params(params: SamplingParams, index: int) -> SamplingParams:
        """Choice `index`'s params: n=1, its own seed, and prompt logprobs only for choice 0
        (they are the same for every choice)."""
        seed = None if params.seed is None else (params.seed + index) % 2**64
        return msgspec.structs.replace(
            params, n=1, seed=seed,
            prompt_logprobs=params.prompt_logprobs if index == 0 else None)

    def add(self, request: Request, held: bool) -> None:
        """Append the next choice; `held`: it waits for choice 0 instead of being queued."""
        self.members.append(request)
        if held:
            self.held.append(request)
        self.live += 1

    def held_choice(self, request_id: str) -> Request | None:
        return next((m for m in self.held if m.request_id == request_id), None)

    def abort_held(self, member: Request) -> None:
        self.held.remove(member)
        member.set_state(RequestState.FINISHED)
        member.finish_reason = "abort"

    def keep_first_row(self, row: npt.NDArray[np.floating]) -> None:
        """Choice 0's first-token logits, kept while choices wait to fork from its prompt KV:
        each samples its own first token from that row."""
        if self.held:
            self.first_row = np.array(row, dtype=np.float32)

    def next_move(self, forks: bool, hybrid: bool) -> Move:
        """What the held choices do now that choice 0 may have its first token.

        With forks (no prefix cache), they start from a copy of choice 0's prompt KV while choice
        0 decodes or is staged (its prompt positions stay as they are); a hybrid model's sliding
        slot changes with choice 0's first decode, so there they fork right away or not at all.
        Without forks (a prefix cache), choice 0's full prompt blocks are published in the cache
        once it decodes, so the others start there. Choices that cannot fork are queued."""
        first = self.members[0]
        if not first.output and first.state is not RequestState.FINISHED:
            return Move.WAIT
        if forks:
            if self.first_row is not None and \
                    first.state in (RequestState.DECODING, RequestState.STAGED) and \
                    (not hybrid or len(first.output) == 1):
                return Move.FORK
            return Move.QUEUE
        return Move.SHARE if first.state is RequestState.DECODING else Move.QUEUE

    def release(self) -> tuple[list[Request], Request | None]:
        """Stop holding the choices: returns those to queue, and the one that now computes the
        request's prompt logprobs (choice 0 ended before its first token), if any, with its
        params already asking for them."""
        heir = None
        if self.prompt_logprobs is not None and self.prompt_result is None and self.held and \
                not self.members[0].output:
            heir = self.held[0]
            heir.params = msgspec.structs.replace(heir.params,
                                                  prompt_logprobs=self.prompt_logprobs)
        queued = list(self.held)
        self.held.clear()
        self.first_row = None
        return queued, heir

    def member_done(self) -> bool:
        """One choice finished; True when it was the last (the request is finished)."""
        self.live -= 1
        return self.live == 0


def num_held(groups: dict[str, Group]) -> int:
    """Choices waiting outside the scheduler for choice 0's prefill."""
    return sum(len(g.held) for g in groups.values()) if groups else 0

"""Output building: `RequestOutput`s and `Completion`s from a request's token arrays.

Text (with stop strings), logprobs, prompt logprobs and the n > 1 fan-out (a choice's outputs
under the request's id, `finished` once every choice is) are built here, outside the scheduler
and the step. `OutputBuilder` keeps what a request needs beyond the scheduler's record
(`Extras`, only for requests that need it) and returns values; the engine decides when a request
ends (the stop rule lives in atombatch/engine/request.py).
"""

from __future__ import annotations

import itertools
from typing import Any

from atombatch.api.structs import Completion, RequestOutput, RequestTimings, TokenLogprobs
from atombatch.engine.groups import Group
from atombatch.engine.request import Request, RequestState
from atombatch.logs import log
from atombatch.sampling.detokenizer import Detokenizer
from atombatch.sampling.sampler import PromptLogprobs, RequestSampler


class Extras:
    """What the engine keeps for a request beyond the scheduler's record (only for requests that
    need it: sampling options, a tokenizer, logprobs or n > 1)."""

    __slots__ = ("detok", "index", "logprobs", "prompt", "prompt_result", "public_id", "sampler",
                 "stop_reason")

    def __init__(self, public_id: str, index: int) -> None:
        self.public_id = public_id            # the id submit() returned
        self.index = index                    # the choice (n > 1)
        self.sampler: RequestSampler | None = None
        self.detok: Detokenizer | None = None
        self.logprobs: list[TokenLogprobs] | None = None
        self.stop_reason: str | int | None = None
        self.prompt: PromptLogprobs | None = None     # prompt logprobs being collected
        self.prompt_result: tuple[TokenLogprobs | None, ...] | None = None  # once delivered


class OutputBuilder:
    """Builds every output of a Batcher's requests.

    Args:
        groups: the n > 1 requests in flight, by the id submit() returned (shared with the
            engine: a choice's final output counts it done, and the last one ends the request).
        vocab_size: the model's vocabulary (bounds prompt logprobs).
    """

    def __init__(self, groups: dict[str, Group], vocab_size: int) -> None:
        self.groups = groups
        self.vocab_size = vocab_size
        self.extras: dict[str, Extras] = {}      # by scheduler request id

    # -- requests ---------------------------------------------------------------------------------
    def track(self, request: Request, public_id: str, index: int, tokenizer: Any | None,
              detokenize: bool) -> Extras | None:
        """The `Extras` of a new request, or None when its outputs need nothing beyond ids (a
        plain greedy n == 1 request without text or logprobs). `tokenizer` (or None: ids
        alone) and `detokenize` (False: only requests with stop strings get text) are the
        Batcher's at submit: a server may attach a tokenizer after construction."""
        params = request.params
        detok = tokenizer is not None and (detokenize or bool(params.stop))
        if request.request_id == public_id and not detok and params.logprobs is None and \
                params.prompt_logprobs is None and params.plain_greedy:
            return None
        extras = self.extras[request.request_id] = Extras(public_id, index)
        if detok:
            extras.detok = Detokenizer(tokenizer, request.prompt, params)
        if params.logprobs is not None:
            extras.logprobs = []
        if params.prompt_logprobs is not None:
            extras.prompt = PromptLogprobs(request.prompt,
                                           min(params.prompt_logprobs, self.vocab_size))
        return extras

    def take_over_prompt_logprobs(self, heir: Request, k: int) -> None:
        """An n > 1 choice computes the request's prompt logprobs (choice 0 ended before its
        first token)."""
        self.extras[heir.request_id].prompt = PromptLogprobs(heir.prompt, min(k, self.vocab_size))

    def prompt_collector(self, request: Request) -> PromptLogprobs | None:
        """The prompt logprobs this request still collects (none once its first token is out:
        a preempted request's recompute needs none)."""
        if not self.extras or request.recomputing:
            return None
        extras = self.extras.get(request.request_id)
        return extras.prompt if extras is not None else None

    def keep_logprobs(self, request: Request, logprobs: TokenLogprobs | None) -> None:
        if logprobs is None:
            return
        extras = self.extras[request.request_id]
        assert extras.logprobs is not None
        extras.logprobs.append(logprobs)

    # -- outputs ----------------------------------------------------------------------------------
    @staticmethod
    def text(request: Request, extras: Extras) -> tuple[str | None, bool]:
        """The text the request's last token adds (None without a detokenizer), and whether a
        stop string matched with it (the text then ends before the stop string)."""
        if extras.detok is None:
            return None, False
        # finished "stop" before the text is read: by a stop id, which is not decoded (vLLM)
        stop_id = request.state is RequestState.FINISHED and request.finish_reason == "stop"
        text = extras.detok.add((request.output[-1],), len(request.output), stop_id)
        return text, extras.detok.stopped is not None

    @staticmethod
    def stopped_by_string(request: Request, extras: Extras) -> None:
        """After the stop rule ran for a stop-string match: a "stop" finish reports the string."""
        if request.finish_reason == "stop" and extras.detok is not None:
            extras.stop_reason = extras.detok.stopped

    def running(self, request: Request, extras: Extras, text: str | None) -> RequestOutput:
        """The output of a request's last token while it goes on."""
        logprobs = None
        if extras.logprobs is not None:
            logprobs = tuple(extras.logprobs[len(request.output) - 1:len(request.output)])
        prompt_logprobs = self._prompt_logprobs_out(request, extras) \
            if extras.prompt is not None else None
        return RequestOutput(request_id=extras.public_id, new_token_ids=(request.output[-1],),
                             finished=False, index=extras.index, text=text, logprobs=logprobs,
                             prompt_logprobs=prompt_logprobs)

    def final(self, request: Request, new: tuple[int, ...], text: str | None,
              now: float) -> RequestOutput:
        """The last output of a finished request (with its `Completion`, timed at `now`); its
        extras are dropped. An n > 1 choice's is `finished` only when it is the last choice."""
        extras = self.extras.pop(request.request_id, None) if self.extras else None
        if extras is None:
            completion = self.completion(request, None, now)
            return RequestOutput(request_id=request.request_id, new_token_ids=new, finished=True,
                                 finish_reason=request.finish_reason, error=request.error,
                                 completion=completion, error_param=request.error_param)
        if extras.detok is not None:
            text = (text or "") + extras.detok.flush()
        prompt_logprobs = self._prompt_logprobs_out(request, extras) \
            if extras.prompt is not None else None
        completion = self.completion(request, extras, now)
        logprobs = None
        if extras.logprobs is not None:
            logprobs = tuple(extras.logprobs[len(request.output) - len(new):])
        finished = True
        group = self.groups.get(extras.public_id) if extras.public_id != request.request_id \
            else None
        if group is not None:
            finished = group.member_done()
            if finished:
                del self.groups[extras.public_id]
        return RequestOutput(request_id=extras.public_id, new_token_ids=new, finished=finished,
                             finish_reason=request.finish_reason, error=request.error,
                             completion=completion, index=extras.index, text=text,
                             logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                             error_param=request.error_param)

    def completion(self, request: Request, extras: Extras | None, now: float) -> Completion:
        timings = None
        if request.admitted_at is not None:
            first = request.first_token_at if request.first_token_at is not None else now
            times = request.token_times
            timings = RequestTimings(
                arrival=request.arrival, admitted=request.admitted_at, first_token=first,
                finished=now, queue_wait=request.admitted_at - request.arrival,
                ttft=first - request.arrival, e2e=now - request.arrival,
                inter_token=tuple(b - a for a, b in itertools.pairwise(times)))
        stop_reason = extras.stop_reason if extras is not None else None
        if stop_reason is None and request.finish_reason == "stop" and request.output and \
                request.output[-1] in request.params.stop_token_ids:
            stop_reason = request.output[-1]  # a stop id (EOS leaves it None, as in vLLM)
        if extras is None:
            return Completion(request_id=request.request_id, prompt_len=len(request.prompt),
                              token_ids=tuple(request.output), finish_reason=request.finish_reason
                              or "error", error=request.error, timings=timings,
                              preemptions=request.preemptions, stop_reason=stop_reason,
                              cached_tokens=max(request.cached_tokens, 0))
        return Completion(request_id=extras.public_id, prompt_len=len(request.prompt),
                          token_ids=tuple(request.output), finish_reason=request.finish_reason or
                          "error", error=request.error, timings=timings,
                          preemptions=request.preemptions, index=extras.index,
                          text=extras.detok.text if extras.detok is not None else None,
                          logprobs=tuple(extras.logprobs) if extras.logprobs is not None else None,
                          stop_reason=stop_reason, prompt_logprobs=self._prompt_result(extras),
                          cached_tokens=max(request.cached_tokens, 0))

    def _prompt_logprobs_out(self, request: Request,
                             extras: Extras) -> tuple[TokenLogprobs | None, ...] | None:
        """The prompt logprobs, built once when the request's first token is out (None on
        every other output)."""
        collector = extras.prompt
        if collector is None or not request.output:
            return None
        extras.prompt = None
        if not collector.complete:  # cannot happen (no prefix-cache read, no PD): never guess
            log.warning("prompt_logprobs.incomplete", request_id=request.request_id)
            return None
        result = extras.prompt_result = collector.result()
        group = self.groups.get(extras.public_id) if self.groups else None
        if group is not None:
            group.prompt_result = result
        return result

    def _prompt_result(self, extras: Extras) -> tuple[TokenLogprobs | None, ...] | None:
        """A completion's prompt logprobs: its own, or (n > 1) the request's, from choice 0."""
        if extras.prompt_result is not None:
            return extras.prompt_result
        group = self.groups.get(extras.public_id) if self.groups else None
        return group.prompt_result if group is not None else None

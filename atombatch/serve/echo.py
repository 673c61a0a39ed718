"""`echo` on `/v1/completions`: the prompt's text, and with `logprobs` its tokens' logprobs, first.

This is how loglikelihood scoring reaches a vLLM server (lm-evaluation-harness
`local-completions` sends `echo: true, logprobs: 1, max_tokens: 0 or 1` and sums the prompt
tokens' logprobs). It rides on the engine's prompt logprobs (`SamplingParams.prompt_logprobs`,
the log-softmax of the raw logits at every prompt position):

- the choice's `text` is the prompt text (as sent, or decoded from its ids) followed by the
  generated text;
- with `logprobs=k`, `logprobs.tokens` / `token_logprobs` / `top_logprobs` / `text_offset` list the
  prompt tokens first, then the generated ones. The first prompt token has no context, so its
  `token_logprobs` and `top_logprobs` entries are `null` (as in vLLM). A prompt position's
  `top_logprobs` holds the k most likely ids and the prompt token itself (so k + 1 entries when it
  is not among them, as vLLM does); -inf is sent as -9999.0;
- `max_tokens=0` (only with echo) generates nothing: the engine runs the prompt's prefill and its
  one sampled token is dropped (`completion_tokens` is 0, `finish_reason` "length").

A runtime that returns only the last position's logits (an ATOM prefill graph compiled with
`logits_to_keep=1`) cannot score a prompt: `echo` with `logprobs` is then a 400 naming `echo`
(echo without logprobs needs no logits and is served everywhere).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from atombatch.api.structs import TokenLogprobs
from atombatch.errors import RequestError
from atombatch.serve.protocol import CompletionLogprobs, CompletionRequest

# -inf as OpenAI and vLLM send it (JSON has no infinity)
MIN_LOGPROB = -9999.0


class Echo:
    """What `echo`, `max_tokens` and `logprobs` ask of one completions request."""

    __slots__ = ("enabled", "generate", "logprobs", "user_prompt_logprobs")

    def __init__(self, body: CompletionRequest) -> None:
        self.enabled = body.echo
        self.generate = body.max_tokens != 0          # max_tokens=0: the prompt only
        self.logprobs = body.logprobs if body.echo else None  # the prompt's top k, when echoed
        self.user_prompt_logprobs = body.prompt_logprobs       # vLLM's own field, if also asked
        if body.max_tokens == 0 and not body.echo:
            raise RequestError("max_tokens=0 generates nothing: it is served only with "
                               "echo=true (scoring the prompt)", param="max_tokens")

    def max_tokens(self, asked: int) -> int:
        """What the engine runs: one token when the client asked for none (it is dropped)."""
        return asked if asked > 0 or not self.enabled else 1

    def prompt_logprobs(self) -> int | None:
        """The engine's `prompt_logprobs`: enough for the echo and for the client's own field."""
        wanted = [k for k in (self.logprobs, self.user_prompt_logprobs) if k is not None]
        if not wanted:
            return None
        return -1 if -1 in wanted else max(wanted)

    def explain(self, exc: RequestError) -> RequestError:
        """An engine refusal of the prompt logprobs that only echo asked for, in echo's words."""
        if self.logprobs is None or self.user_prompt_logprobs is not None or \
                exc.param != "prompt_logprobs":
            return exc
        reason = str(exc).split(": ", 1)[-1]
        return RequestError(f"echo=true with logprobs={self.logprobs} needs the logprobs of "
                            f"every prompt token: {reason}", param="echo")


def echo_logprobs(prompt: Sequence[int], entries: Sequence[TokenLogprobs | None] | None,
                  token_text: Callable[[int], str]) -> CompletionLogprobs:
    """The prompt part of a completion's logprobs (offsets from 0).

    Raises:
        RequestError: the engine sent no (or mismatched) prompt logprobs.
    """
    if entries is None or len(entries) != len(prompt):
        raise RequestError("the engine returned no prompt logprobs for an echoed prompt",
                           param="echo")
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0
    for token, entry in zip(prompt, entries, strict=True):
        text = token_text(token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(max(entry.logprob, MIN_LOGPROB))
        top = {token_text(t.token_id): max(t.logprob, MIN_LOGPROB) for t in entry.top}
        top.setdefault(text, max(entry.logprob, MIN_LOGPROB))
        tops.append(top)
    return CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops,
                              text_offset=offsets)


def joined(head: CompletionLogprobs, tail: CompletionLogprobs | None) -> CompletionLogprobs:
    """The prompt's logprobs followed by the generated tokens' (their offsets moved past it)."""
    if tail is None:
        return head
    shift = (head.text_offset[-1] + len(head.tokens[-1])) if head.tokens else 0
    return CompletionLogprobs(tokens=head.tokens + tail.tokens,
                              token_logprobs=head.token_logprobs + tail.token_logprobs,
                              top_logprobs=head.top_logprobs + tail.top_logprobs,
                              text_offset=head.text_offset + [o + shift for o in tail.text_offset])

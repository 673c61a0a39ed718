"""A generated token's candidates can have logprob -inf (an id a mask removed in "processed"
logprobs mode, or a logit the device returned as -inf): JSON has no -inf, and msgspec would
write null, which OpenAI's clients refuse for a float field. They are sent as -9999.0, as vLLM
does (and as prompt logprobs already are)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from support.serving import ART, NAME, WEIGHT_SEED, ServerThread

from atombatch import Batcher
from atombatch.runtime.numpy_runtime import NumpyRuntime
from atombatch.serve import create_app

ALLOWED = [5, 6]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    batcher = Batcher(NumpyRuntime.random(ART, seed=WEIGHT_SEED), logprobs_mode="processed")
    with ServerThread(create_app(batcher, NAME)) as s:
        yield s


def test_completion_candidates_a_mask_removed_are_sent_as_minus_9999(server: ServerThread) -> None:
    for stream in (False, True):
        r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "prompt": [9, 10, 11], "max_tokens": 3, "temperature": 0, "logprobs": 4,
            "allowed_token_ids": ALLOWED, "stream": stream})
        assert r.status_code == 200
        if stream:
            choices = [c for line in r.text.splitlines()
                       if line.startswith("data: {") for c in json.loads(line[6:])["choices"]]
            tops = [t for c in choices if c.get("logprobs") for t in c["logprobs"]["top_logprobs"]]
        else:
            tops = r.json()["choices"][0]["logprobs"]["top_logprobs"]
        assert len(tops) == 3
        for top in tops:
            values = list(top.values())
            assert len(values) == 4 and None not in values
            # the two allowed ids hold all the mass; the other two candidates were masked
            assert sorted(values)[:2] == [-9999.0, -9999.0] and min(values[:2]) > -9999.0


def test_chat_candidates_a_mask_removed_parse_with_the_openai_client(
        server: ServerThread) -> None:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        out = client.chat.completions.create(
            model=NAME, max_tokens=3, temperature=0, logprobs=True, top_logprobs=4,
            messages=[{"role": "user", "content": "<20><21>"}],
            extra_body={"allowed_token_ids": ALLOWED})
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3
    for entry in content:
        values = [t.logprob for t in entry.top_logprobs]
        assert sorted(values)[:2] == [-9999.0, -9999.0] and entry.logprob > -9999.0

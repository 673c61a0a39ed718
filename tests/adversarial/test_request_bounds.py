"""Issue 18 items 1-9: what one request may cost the server, whatever its body says.

Each attack is small to send and failed on 21fd0af: a 10 MiB id list stalled every stream for 20 s
(a path string built per list element), deep nesting and non-latin-1 field names answered 500,
`chat_template_kwargs` overrode the tokenizer's `eos_token` (42 s and +1.9 GiB for 64 messages),
`prompt_logprobs` x `n` turned 5 KiB into 90 MiB, and a response that failed to start left its
request generating for nobody. A victim stream runs beside the attacks and its longest gap between
two events is bounded (`VICTIM_GAP`, documented in docs/security.md).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.rss import MiB, peak_rss_bytes
from support.served import served
from support.victim import (
    NAME,
    RSS_BOUND,
    VICTIM_GAP,
    Victim,
)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# A template that prints the end-of-turn token after every message: what made a client-chosen
# `eos_token` amplify (the tokenizer's own eos is short).
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {{ eos_token }} "
            "{% endfor %}{% if add_generation_prompt %}assistant {% endif %}")


def _tokenizer_dir(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "</s>", "user", "assistant", "system"] + [f"w{i}" for i in range(200)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    directory = _tokenizer_dir(tmp_path_factory.mktemp("tok"))
    with served("--tokenizer", str(directory), "--chat-template", TEMPLATE,
                "--max-waiting", "64") as s:
        yield s


def _post(url: str, path: str, body: bytes) -> httpx.Response:
    return httpx.post(url + path, content=body, headers={"content-type": "application/json"},
                      timeout=120)


def _body(**fields: object) -> bytes:
    return json.dumps({"model": NAME, "max_tokens": 1, **fields}).encode()


ATTACKS = {
    # item 1: sizes that cost Python time per element while parsing
    "10 MiB prompt id list": (COMPLETIONS, _body(prompt=[7] * 2_500_000), 400, "prompt"),
    "2.6 M allowed_token_ids": (COMPLETIONS, _body(prompt="w1", allowed_token_ids=[5] * 2_600_000),
                                400, "allowed_token_ids"),
    "2.6 M stop_token_ids": (COMPLETIONS, _body(prompt="w1", stop_token_ids=[5] * 2_600_000), 400,
                             "stop_token_ids"),
    "500 k content parts": (CHAT, _body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "w1"}] * 500_000}]), 400, None),
    "262 k logit_bias keys": (COMPLETIONS, _body(prompt="w1", logit_bias={
        str(i): 1.0 for i in range(262_144)}), 400, "logit_bias"),
    "batch of 2 000 x 1 000 ids": (COMPLETIONS, _body(prompt=[[7] * 1000] * 2000), 400, "prompt"),
    # item 2: nesting
    "prompt nested 100 000 deep": (COMPLETIONS, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000
                                   + b"}", 400, None),
    "tool_calls nested 700 deep": (CHAT, json.dumps({"messages": [{
        "role": "assistant", "content": "w1", "tool_calls": [{"function": json.loads(
            "[" * 700 + "]" * 700)}]}]}).encode(), 400, None),
    "chat_template_kwargs nested 700 deep": (CHAT, json.dumps({
        "messages": [{"role": "user", "content": "w1"}],
        "chat_template_kwargs": {"x": json.loads("[" * 700 + "]" * 700)}}).encode(), 400, None),
    # item 3: a client-chosen special token printed after every message
    "256 KiB eos_token x 64 messages": (CHAT, _body(
        messages=[{"role": "user", "content": "w1"}] * 64,
        chat_template_kwargs={"eos_token": "w2 " * 87_000}), 400, "chat_template_kwargs"),
    # item 4: keywords that collide with the renderer's own arguments
    "chat_template_kwargs messages": (CHAT, _body(messages=[{"role": "user", "content": "w1"}],
                                                  chat_template_kwargs={"messages": []}), 400,
                                      "chat_template_kwargs"),
    "chat_template_kwargs self": (CHAT, _body(messages=[{"role": "user", "content": "w1"}],
                                              chat_template_kwargs={"self": 1}), 400,
                                  "chat_template_kwargs"),
    "chat_template_kwargs tools": (CHAT, _body(messages=[{"role": "user", "content": "w1"}],
                                               chat_template_kwargs={"tools": 5}), 400,
                                   "chat_template_kwargs"),
    "chat_template_kwargs documents": (CHAT, _body(messages=[{"role": "user", "content": "w1"}],
                                                   chat_template_kwargs={"documents": 5}), 400,
                                       "chat_template_kwargs"),
    # item 7: logprob entries repeated per choice
    "prompt_logprobs=20 x n=64": (COMPLETIONS, _body(prompt=" ".join(["w3"] * 900), n=64,
                                                     prompt_logprobs=20), 400, "n"),
    # item 9: a sampling combination that masks every token
    "min_tokens with only eos allowed": (COMPLETIONS, _body(prompt="w1", max_tokens=4,
                                                            min_tokens=2, allowed_token_ids=[2]),
                                         400, "allowed_token_ids"),
    "bad_words banning every allowed id": (COMPLETIONS, _body(prompt="w1", max_tokens=4,
                                                              allowed_token_ids=[7],
                                                              bad_words=["w2"]), 400, "bad_words"),
    # a text that cannot fit the context is refused before it is tokenized
    "8 MiB of text": (COMPLETIONS, _body(prompt="w5 " * 2_800_000), 400, "prompt"),
    "8 MiB chat message": (CHAT, _body(messages=[{"role": "user", "content": "w5 " * 2_800_000}]),
                           400, "messages"),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_an_attack_is_answered_400_without_stalling_a_victim(server: tuple[str, int],
                                                             attack: str) -> None:
    url, pid = server
    path, body, status, param = ATTACKS[attack]
    before = peak_rss_bytes(pid)
    with Victim(url) as victim:
        time.sleep(0.2)
        start = time.perf_counter()
        response = _post(url, path, body)
        end = time.perf_counter()
    assert victim.error is None, victim.error
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    assert len(error["message"]) < 600  # the client's data is never echoed in full
    gap = victim.gap_during(start, end)
    assert gap < VICTIM_GAP, f"{attack}: the victim stream paused {gap:.2f} s"
    grown = peak_rss_bytes(pid) - before
    assert grown < RSS_BOUND, f"{attack}: the server's peak RSS grew {grown / MiB:.0f} MiB"


def test_special_tokens_of_the_tokenizer_still_reach_the_template(server: tuple[str, int]) -> None:
    url, _ = server
    r = _post(url, CHAT, _body(messages=[{"role": "user", "content": "w1"}], max_tokens=1,
                               prompt_logprobs=0))
    assert r.status_code == 200, r.text
    # user w1 </s> assistant: the tokenizer's eos (id 1) follows the message
    prompt_ids = [int(next(iter(p))) for p in r.json()["prompt_logprobs"][1:]]
    assert prompt_ids == [5 + 1, 1, 3]


def test_unknown_field_names_are_sanitized_clipped_and_counted(server: tuple[str, int]) -> None:
    """Item 5: a non-latin-1 name answered 500 (building X-Ignored-Fields); 48 names of 4 MiB
    were kept in memory, logged and echoed in full."""
    url, pid = server
    r = _post(url, COMPLETIONS, _body(prompt="w1", **{"名前": 1, "bad\r\nheader": 2}))
    assert r.status_code == 200, r.text
    listed = r.headers["x-ignored-fields"]
    assert listed.isascii() and "\r" not in listed and "\n" not in listed
    assert "\\u540d\\u524d" in listed
    before = peak_rss_bytes(pid)
    fields = {f"{i:02d}" + "x" * (4 * MiB): i for i in range(3)}
    r = _post(url, COMPLETIONS, _body(prompt="w1", **fields))
    assert r.status_code == 200, r.text[:200]
    header = r.headers["x-ignored-fields"]
    assert len(header) < 2000 and f"({4 * MiB + 2} chars)" in header
    assert peak_rss_bytes(pid) - before < 200 * MiB  # the body and its decoding, not kept copies


def test_a_response_that_cannot_start_aborts_its_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 6: when the response failed to start after its requests were queued (on 21fd0af: a
    header that could not be encoded), nothing aborted them: 40 such requests generated 40 016
    tokens for nobody and a victim's first token went from 0.04 s to 56.6 s. Here building the
    response fails after submit; the engine must end up with nothing running."""
    from support.engines import numpy_batcher
    from support.served import ServerThread

    from atombatch.serve import create_app
    from atombatch.serve.app import _Server

    def broken(self: _Server, request: object) -> dict[str, str]:
        raise RuntimeError("the response cannot start")

    monkeypatch.setattr(_Server, "headers", broken)
    batcher = numpy_batcher()
    app = create_app(batcher, NAME)
    with ServerThread(app) as s:
        for stream in (True, False):
            r = httpx.post(s.url + COMPLETIONS, json={
                "model": NAME, "prompt": [5, 6], "max_tokens": 100, "ignore_eos": True,
                "stream": stream, "n": 2}, timeout=60)
            assert r.status_code == 500
        deadline = time.monotonic() + 20
        while batcher.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not batcher.has_unfinished()
        stats = batcher.stats()
        assert stats.generated_tokens < 2 * 2 * 100  # aborted, not run to max_tokens


def test_generate_after_a_step_loop_failure_reports_the_failure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 13: `AsyncBatcher.generate()` after the step loop failed raised `ValueError: not
    enough values to unpack` and lost the real error."""
    import asyncio

    from support.engines import numpy_batcher

    from atombatch import AsyncBatcher, SamplingParams

    batcher = numpy_batcher()
    real_step = batcher.step
    calls = {"n": 0}

    def failing_step() -> object:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device lost")
        return real_step()

    monkeypatch.setattr(batcher, "step", failing_step)

    async def main() -> None:
        async with AsyncBatcher(batcher, offload=False) as ab:
            params = SamplingParams(max_tokens=20, ignore_eos=True, n=2, temperature=0.0)
            first = await ab.generate_choices([5, 6, 7], params)
            assert [c.finish_reason for c in first] == ["error", "error"]
            assert all("device lost" in (c.error or "") for c in first)
            again = await ab.generate([5, 6, 7], SamplingParams(max_tokens=3))
            assert again.finish_reason == "length" and len(again.token_ids) == 3

    asyncio.run(main())


@pytest.mark.parametrize("forged", [
    {"summary_hashes": 10**6}, {"summary_hashes": 0}, {"summary_hashes": "7"},
    {"route_block": 10**9}, {"summary_count": -1}, {"summary_bits_len": 10**6}])
def test_a_forged_replica_summary_is_ignored(forged: dict[str, object]) -> None:
    """Item 12: a replica report with `summary_hashes=10**6` was accepted (the size check ran
    only where summaries are built) and each routing decision then cost 2-3 s and 382 MiB."""
    from atombatch.cluster.summary import MAX_SUMMARY_BITS, CacheSummary
    from atombatch.serve.ray import summary_from_stats

    honest = CacheSummary.build([bytes([i]) * 16 for i in range(10)], bits=4096)
    stats: dict[str, object] = {"summary_bits": honest.bits, "summary_hashes": honest.hashes,
                                "summary_count": honest.count, "route_block": 64}
    assert summary_from_stats(stats) == honest
    if "summary_bits_len" in forged:
        stats["summary_bits"] = bytes(MAX_SUMMARY_BITS // 8 + 8)
    else:
        stats.update(forged)
    assert summary_from_stats(stats) is None


def test_a_long_token_against_many_stop_strings_does_not_stall_the_steps(
        tmp_path: Path) -> None:
    """Item 8: a 100 000-character token checked against 64 stop strings cost 925 ms per step
    (the stop automata advanced in Python character by character), and the stop check runs
    where the steps run. A victim's longest pause while such a request generates is bounded."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "</s>", "x" * 100_000] + [f"w{i}" for i in range(200)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with served("--tokenizer", str(tmp_path)) as (url, _):
        hostile = _body(prompt="w1 w2", max_tokens=12, ignore_eos=True, allowed_token_ids=[2],
                        stop=[f"y{i:03d}" for i in range(64)])
        with Victim(url) as victim:
            time.sleep(0.2)
            start = time.perf_counter()
            response = _post(url, COMPLETIONS, hostile)
            end = time.perf_counter()
        assert response.status_code == 200, response.text[:300]
        assert response.json()["choices"][0]["text"].replace(" ", "") == "x" * 1_200_000
        gap = victim.gap_during(start, end)
        assert gap < 0.6, f"the victim stream paused {gap:.2f} s"


def test_many_stop_ids_cost_the_stop_rule_no_more_than_one() -> None:
    """Item 8: 262 144 `stop_token_ids` made a neighbour's inter-token latency x5.6: past the
    kernel's 16 stop ids the lane falls back to `check_stop`, which scanned the tuple every step.
    The rule's cost must not grow with the list (a scan of 2**18 ids is ~10 000 x one lookup; the
    bound below leaves a 200 x margin for a noisy machine)."""
    import timeit

    import numpy as np

    from atombatch.api.structs import SamplingParams
    from atombatch.engine.request import Request, check_stop

    def request(stops: list[int]) -> Request:
        params = SamplingParams(max_tokens=100, stop_token_ids=stops, ignore_eos=True)
        r = Request("r", np.arange(1, 5, dtype=np.int64), params, 0.0,
                    np.random.default_rng(0), 256)
        r.output.extend([5, 6])
        return r

    few, many = request([3]), request(list(range(7, 7 + 2**18)))
    token = 5  # in neither list: a scan reads every id

    def cost(r: Request) -> float:
        return min(timeit.repeat(lambda: check_stop(r, token, ()), number=200, repeat=5))

    assert cost(many) < 50 * cost(few)

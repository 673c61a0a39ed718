"""The surfaces of issue 19 (structured output, tools, echo, /tokenize and /detokenize) attacked as
a hostile client would, over loopback, with a victim stream timed alongside (issue 18's rule:
every size a client controls is bounded before it is parsed, allocated, rendered, tokenized or
iterated; no request stalls other streams beyond `VICTIM_GAP`; never a 500).

What failed on eb41a07 (each is small to send):
- `/detokenize` of 8 M ids: 200 after 2.9 s with every other stream stopped 2.7 s (a Python loop
  over the ids and the decode on the event loop; no bound on the list).
- 12 concurrent 16-character regexes (`(a{1000}){1000}`, each a little different): 64 s to answer
  them all, the front's peak RSS +2.2 GiB (each compile check spent 3 s and 250 MiB of
  llguidance's default lexer budget, on up to six threads of the default executor, and kept a
  copy of every matcher), the engine core +1.4 GiB after 40 of them (64 compiled matchers kept),
  and a new honest constraint waited behind them all. Each was answered 500 "engine_error":
  the regex passes the compile check and runs out of llguidance's budget at its first token.
- `echo` with `logprobs=20` (or `prompt_logprobs=20`) on a batch of long prompts, inside the
  response budget: every other stream stopped 2.3-2.8 s while the prompt logprobs were formatted
  on the event loop (the echo head once per choice).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.rss import MiB, peak_rss_bytes
from support.served import served
from support.victim import NAME, RSS_BOUND, VICTIM_GAP, Victim

CONTEXT = 512
# three times the default budget: formatting a response's logprobs must not stall other streams
# however many of them the operator allows
RESPONSE_BYTES = 96 * MiB


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """A Qwen3 checkpoint with a byte-level tokenizer (what structured output needs), tools and
    a reasoning parser, the engine in its own process (the CLI's default)."""
    from support.structured import checkpoint_dir

    directory = checkpoint_dir(Path(tmp_path_factory.mktemp("ckpt")))
    with served(str(directory), "--served-model-name", NAME, "--max-model-len", str(CONTEXT),
                "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                "--max-waiting", "200", "--max-response-bytes", str(RESPONSE_BYTES)) as s:
        yield s


def _timed(url: str, pid: int, path: str, content: bytes) -> tuple[httpx.Response, float, float]:
    """POST `content` while a victim streams: (response, the victim's longest pause, the
    server's peak RSS growth)."""
    before = peak_rss_bytes(pid)
    with Victim(url) as victim:
        time.sleep(0.2)
        start = time.perf_counter()
        response = httpx.post(url + path, content=content,
                              headers={"content-type": "application/json"}, timeout=300)
        end = time.perf_counter()
    assert victim.error is None, victim.error
    return response, victim.gap_during(start, end), peak_rss_bytes(pid) - before


def test_detokenize_of_millions_of_ids_is_refused_without_stalling(
        server: tuple[str, int]) -> None:
    url, pid = server
    for tail in (b"", b",99999"):  # in range, and one bad id at the very end
        body = b'{"tokens":[' + b",".join([b"7"] * 8_000_000) + tail + b"]}"
        r, gap, grown = _timed(url, pid, "/detokenize", body)
        assert r.status_code == 400, r.text[:300]
        error = r.json()["error"]
        assert error["param"] == "tokens" and str(CONTEXT) in error["message"], error
        assert gap < VICTIM_GAP, f"the victim stream paused {gap:.2f} s"
        assert grown < RSS_BOUND, f"the server's peak RSS grew {grown / MiB:.0f} MiB"
    ok = httpx.post(url + "/detokenize", json={"tokens": [40, 41, 42]}, timeout=30)
    assert ok.status_code == 200 and ok.json()["prompt"], ok.text
    bad = httpx.post(url + "/detokenize", json={"tokens": [40, 10**12, -1]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[1]", bad.text


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_distinct_pathological_regexes_cost_bounded_time_and_memory(
        server: tuple[str, int]) -> None:
    url, pid = server
    core = max(_children(pid), key=lambda c: peak_rss_bytes(c))  # the engine core process
    before, core_before = peak_rss_bytes(pid), peak_rss_bytes(core)

    def attack(i: int) -> int:
        body = {"model": NAME, "prompt": "hi", "max_tokens": 4,
                "structured_outputs": {"regex": "(a{1000}){1000}" + "b" * i}}
        return httpx.post(url + "/v1/completions", json=body, timeout=300).status_code

    with Victim(url) as victim, concurrent.futures.ThreadPoolExecutor(12) as pool:
        time.sleep(0.2)
        start = time.perf_counter()
        storm = [pool.submit(attack, i) for i in range(12)]
        time.sleep(0.5)  # an honest, new constraint sent while the storm is being checked
        honest = httpx.post(url + "/v1/completions", json={
            "model": NAME, "prompt": "hi", "max_tokens": 4,
            "structured_outputs": {"choice": ["yes", "no", "maybe"]}}, timeout=300)
        honest_done = time.perf_counter()
        statuses = [f.result() for f in storm]
        end = time.perf_counter()
    assert victim.error is None, victim.error
    assert honest.status_code == 200, honest.text
    assert honest.json()["choices"][0]["text"] in ("yes", "no", "maybe")
    assert honest_done - start < 20, f"the honest constraint waited {honest_done - start:.1f} s"
    assert end - start < 30, f"the storm took {end - start:.1f} s ({statuses})"
    assert all(s in (400, 429) for s in statuses), statuses  # never a 500
    gap = victim.gap_during(start, end)
    assert gap < VICTIM_GAP, f"the victim stream paused {gap:.2f} s"
    grown = peak_rss_bytes(pid) - before
    assert grown < RSS_BOUND, f"the server's peak RSS grew {grown / MiB:.0f} MiB"
    core_grown = peak_rss_bytes(core) - core_before
    assert core_grown < 3 * RSS_BOUND, f"the core's peak RSS grew {core_grown / MiB:.0f} MiB"


ECHOES = {
    "echo logprobs=20": {"echo": True, "logprobs": 20, "max_tokens": 0},
    "prompt_logprobs=20": {"prompt_logprobs": 20, "max_tokens": 1},
    "echo logprobs=20 streamed": {"echo": True, "logprobs": 20, "max_tokens": 0, "stream": True},
}


@pytest.mark.parametrize("kind", list(ECHOES))
def test_prompt_logprobs_of_a_batch_are_formatted_without_stalling(
        server: tuple[str, int], kind: str) -> None:
    import json

    url, pid = server
    prompt = list(range(3, 3 + 500))
    n = 3
    batch = RESPONSE_BYTES // (n * 500 * 21 * 64) - 1  # just inside the response budget
    body = {"model": NAME, "prompt": [prompt] * batch, "n": n, **ECHOES[kind]}
    r, gap, grown = _timed(url, pid, "/v1/completions", json.dumps(body).encode())
    assert r.status_code == 200, r.text[:300]
    assert gap < VICTIM_GAP, f"{kind}: the victim stream paused {gap:.2f} s"
    if not body.get("stream"):
        choices = r.json()["choices"]
        assert len(choices) == batch * n
        lp = choices[-1]["logprobs"] or {}
        entries = lp.get("top_logprobs") or choices[-1]["prompt_logprobs"]
        assert len(entries) >= 500 and entries[0] is None and len(entries[1]) >= 2


def test_a_constraint_that_fails_mid_generation_is_the_clients_error(
        server: tuple[str, int]) -> None:
    """The first mask of `(a{1000}){1000}` fits llguidance's budget, its first token does not:
    the request fails while it generates. That is the client's constraint, not a server fault:
    a 400 naming the field (a stream: an error event naming it), never a 500."""
    import json

    url, _ = server
    body = {"model": NAME, "prompt": "hi", "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "string", "pattern": "^(a{1000}){1000}$"}}}}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == "response_format" and error["code"] == "constraint_failed", error
    streamed = {"model": NAME, "prompt": "hi", "max_tokens": 4, "stream": True,
                "structured_outputs": {"regex": "(a{1000}){1000}"}}
    with httpx.stream("POST", url + "/v1/completions", json=streamed, timeout=120) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    errors = [e["error"] for e in events if "error" in e]
    assert errors and errors[0]["param"] == "structured_outputs", events[-3:]
    assert errors[0]["type"] == "invalid_request_error"


@pytest.fixture(scope="module")
def long_tokens(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """A tokenizer whose words are 2 000 characters long: a prompt of ids decodes to 4 000 times
    its size in the request."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    path = Path(tmp_path_factory.mktemp("long"))
    words = ["<unk>", "</s>"] + [f"w{i}" for i in range(50)] + \
        [chr(ord("a") + i) * 2000 for i in range(20)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with served("--tokenizer", str(path), "--max-waiting", "64") as s:
        yield s


def test_an_echoed_prompt_counts_in_the_response_budget(long_tokens: tuple[str, int]) -> None:
    """eb41a07: `echo` copies the prompt's text into every choice and the response estimate left
    it out: 500 ids of a 2 000-character word with n=40 answered 40 MB (the budget is 32 MiB)."""
    url, pid = long_tokens
    ids = [60] * 500
    before = peak_rss_bytes(pid)
    r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": ids, "echo": True,
                                                   "max_tokens": 1, "n": 40}, timeout=300)
    assert r.status_code == 400, f"{r.status_code}: {len(r.content) / MiB:.0f} MiB"
    error = r.json()["error"]
    assert error["code"] == "response_too_large" and error["param"] == "n", error
    assert peak_rss_bytes(pid) - before < RSS_BOUND
    ok = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": ids[:5], "echo": True,
                                                    "max_tokens": 1, "n": 2}, timeout=300)
    assert ok.status_code == 200, ok.text[:300]
    assert all(c["text"].startswith(" ".join(["i" * 2000] * 5)) for c in ok.json()["choices"])

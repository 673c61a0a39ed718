"""`python -m atombatch.serve --pd-producer ENDPOINT` end to end: a NumPy producer in its own
process, the server (front and engine core) in another, HTTP from the test. The reference is each
request run alone on an in-process engine built from the same flags (native prefill)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.producers import run_producer_process
from support.served import served

from atombatch.api.structs import SamplingParams
from atombatch.core.pd import handshake
from atombatch.serve.cli import DEFAULT_SPEC, build_engine, parser

pytestmark = pytest.mark.numerics

FLAGS = ["--batch-size", "2", "--max-seq-len", "128", "--seed", "4"]
PRODUCER_LAYOUT = dict(batch_size=1, max_seq_len=128, block_size=32, num_blocks=4,
                       prefill_chunk_size=32)   # another layout than the server's


def alone(prompt: list[int], max_tokens: int) -> list[int]:
    batcher, _, _ = build_engine(parser().parse_args(FLAGS))
    [done] = batcher.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                      ignore_eos=True))
    return list(done.token_ids)


def counters(url: str) -> dict[str, float]:
    """The engine's and the PD pool's samples, by name (and label values)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.name + "".join(f"[{v}]" for v in s.labels.values()): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith(("atombatch_engine_", "atombatch_pd_"))}


def test_serve_with_a_static_pd_producer_over_http(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/producer.sock"
    producer = multiprocessing.get_context("spawn").Process(
        target=run_producer_process, args=(DEFAULT_SPEC, PRODUCER_LAYOUT, 4, endpoint),
        daemon=True)
    producer.start()
    try:
        deadline = time.monotonic() + 60
        while not handshake(endpoint, timeout=0.5):
            assert time.monotonic() < deadline, "the producer did not come up"
        prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 70)), [3] * 33]
        want = [alone(p, 8) for p in prompts]
        with served(*FLAGS, "--pd-producer", endpoint, "--pd-probe-s", "0.2",
                    "--pd-timeout", "20") as (url, _):
            http = httpx.Client(timeout=60)
            body = {"prompt": prompts[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            answer = http.post(f"{url}/v1/completions", json=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["token_ids"] == want[0]
            ids: list[int] = []
            with http.stream("POST", f"{url}/v1/completions",
                             json={**body, "prompt": prompts[1], "stream": True}) as stream:
                lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
            for line in lines[:-1]:
                ids.extend(httpx.Response(200, content=line[6:]).json()["choices"][0]
                           .get("token_ids") or [])
            assert ids == want[1] and lines[-1] == "data: [DONE]"
            seen = counters(url)
            assert seen["atombatch_engine_imports_total"] >= 2     # both prompts from the producer
            assert seen["atombatch_engine_prefill_chunks_total"] == 0
            assert seen["atombatch_pd_producers[live]"] == 1
            assert seen["atombatch_pd_opened_total[producer-0]"] == 2
            assert seen["atombatch_pd_in_flight[producer-0]"] == 0

            # the producer dies while idle: the core's probe stops using it, the next request
            # is prefilled by the core itself, with the same tokens
            os.kill(producer.pid, signal.SIGKILL)
            producer.join(10)
            deadline = time.monotonic() + 10
            while counters(url)["atombatch_pd_producers[suspect]"] != 1:
                assert time.monotonic() < deadline, "the core did not find the producer gone"
                time.sleep(0.1)
            answer = http.post(f"{url}/v1/completions", json={**body, "prompt": prompts[2]})
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["token_ids"] == want[2]
            seen = counters(url)
            assert seen["atombatch_engine_prefill_chunks_total"] > 0
            assert seen["atombatch_pd_native_fallbacks_total"] == 1
            assert seen["atombatch_pd_opened_total[producer-0]"] == 2
            assert http.get(f"{url}/health").status_code == 200
            http.close()
    finally:
        if producer.is_alive():
            producer.kill()
        producer.join(5)


@pytest.mark.parametrize(("flags", "message"), [
    (["--pd-producer", "http://127.0.0.1:1"], "is not a ZeroMQ endpoint"),
    (["--pd-producer", "tcp://127.0.0.1:1", "--engine-core", "inline"], "needs --engine-core"),
    (["--pd-producer", "tcp://127.0.0.1:1", "--pd-timeout", "0"], "--pd-timeout 0"),
])
def test_bad_pd_flags_exit_2_naming_the_rule(flags: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "atombatch.serve", "--port", "0", *flags],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr

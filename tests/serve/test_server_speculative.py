"""`--speculative-config` through the server in every engine-core mode (`--engine-core inline`,
`process`, `--api-server-count 2`): the same greedy completions as a server without it, and
vLLM's `vllm:spec_decode_*` series in `/metrics` counting the verify calls; a bad value exits
with status 2 naming the field."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from support.served import served
from support.speculative import repeating_prompts
from support.structured import checkpoint_dir

MODES = {"inline": ("--engine-core", "inline"), "process": ("--engine-core", "process"),
         "fronts": ("--api-server-count", "2")}
SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoint_dir(tmp_path_factory.mktemp("speculative"))


@pytest.fixture(scope="module")
def urls(model: Path) -> Iterator[dict[str, str]]:
    with contextlib.ExitStack() as stack:
        common = ("--model", str(model), "--max-model-len", "512", "--batch-size", "1",
                  "--served-model-name", "tiny")
        found = {"plain": stack.enter_context(served(*common, "--engine-core", "inline"))[0]}
        for mode, flags in MODES.items():
            found[mode] = stack.enter_context(served(*common, *flags,
                                                     "--speculative-config", SPEC))[0]
        yield found


def complete(url: str, prompt: list[int]) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={
        "model": "tiny", "prompt": prompt, "max_tokens": 30, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return {"text": choice["text"], "finish_reason": choice["finish_reason"]}


def spec_series(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("vllm:spec_decode")}


def test_same_completions_in_every_mode_and_the_metrics(urls: dict[str, str]) -> None:
    prompts = [[t % 256 + 3 for t in p] for p in repeating_prompts(np.random.default_rng(1))]
    want = [complete(urls["plain"], p) for p in prompts]
    assert not spec_series(urls["plain"])  # not configured: not exported
    for mode in MODES:
        assert [complete(urls[mode], p) for p in prompts] == want, mode
        series = spec_series(urls[mode])
        drafts = [v for k, v in series.items() if k.startswith("vllm:spec_decode_num_drafts")]
        assert drafts and drafts[0] > 0, (mode, series)
        assert sum(1 for k in series if "per_pos" in k) == 3


def test_bad_speculative_config_exits_2_naming_the_field(model: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "atombatch.serve", "--model", str(model),
                           "--max-model-len", "512", "--speculative-config",
                           '{"method": "eagle", "num_speculative_tokens": 2}'],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "speculative_config.method='eagle'" in done.stderr

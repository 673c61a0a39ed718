"""A client this project does not control drives the server like a load generator: zero failures.

The client is the official `openai` Python SDK (`AsyncOpenAI`), the library most OpenAI-compatible
load generators and applications are built on. Dedicated load generators were weighed and not
taken for CI: guidellm 0.8.1 pulls torch unpinned (a CUDA build) plus datasets/pandas/pyarrow,
aiperf 0.13 about a hundred packages (dash, optuna, scipy, a Kubernetes client) and a
multi-process service, inference-perf needs Python >= 3.12. The requests carry what guidellm
sends a vLLM server (`stream_options.continuous_usage_stats`, `ignore_eos`, nulls, an unknown
field), the field set that made every guidellm request fail before.

Like a load generator, the test builds text prompts of a chosen token length with the model's
tokenizer (transformers' `AutoTokenizer` on a checkpoint written by transformers), sends them as
16 concurrent streams (completions and chat), and checks every response: no error, exactly
`max_tokens` tokens, the prompt token count the tokenizer predicts, and the streamed text equal
to the decoded greedy reference.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import openai
from support.serving import ServerThread, metrics, wait_idle
from support.templates import QWEN3, save_checkpoint

from atombatch import ArtifactConfig, Batcher, ModelSpec, SamplingParams
from atombatch.runtime.numpy_runtime import NumpyRuntime
from atombatch.serve import create_app
from atombatch.serve.tokens import HFCodec

NAME = "third-party"
SPEC = ModelSpec(name=NAME, family="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, bos_token_id=1,
                 eos_token_ids=(2,), dtype="float32")
ART = ArtifactConfig(model=SPEC, batch_size=4, max_seq_len=256, block_size=64, num_blocks=17,
                     prefill_chunk_size=32, kv_dtype="float32")
SEED = 11
REQUESTS = 32
CONCURRENCY = 16
WORDS = ["the", "weather", "in", "seoul", "is", "humid", "today", "you", "may", "call", "these",
         "functions", "city", "hello", "world"]


def text_of_tokens(tokenizer: Any, rng: random.Random, n: int) -> str:
    """Words appended until the tokenizer counts `n` tokens (how load generators size prompts)."""
    words: list[str] = []
    while True:
        candidate = " ".join([*words, rng.choice(WORDS)])
        if len(tokenizer(candidate, add_special_tokens=False)["input_ids"]) > n:
            return " ".join(words)
        words = candidate.split(" ")


def test_openai_async_client_at_c16_has_no_failures(tmp_path: Path) -> None:
    hf = save_checkpoint(tmp_path, QWEN3, None, "<|im_end|>")
    codec = HFCodec.from_dir(tmp_path)
    rng = random.Random(3)
    jobs = []
    for i in range(REQUESTS):
        text = text_of_tokens(hf, rng, rng.randrange(8, 60))
        max_tokens = rng.randrange(4, 24)
        if i % 2:
            messages = [{"role": "user", "content": text}]
            ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = ids if isinstance(ids, list) else ids["input_ids"]
            jobs.append(("chat", messages, list(ids), max_tokens))
        else:
            ids = hf(text, add_special_tokens=False)["input_ids"]
            jobs.append(("completion", text, list(ids), max_tokens))
    reference = Batcher(NumpyRuntime.random(ART, seed=SEED))
    want = [list(c.token_ids) for c in (reference.generate(
        [ids], SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))[0]
        for _, _, ids, m in jobs)]

    app = create_app(Batcher(NumpyRuntime.random(ART, seed=SEED), max_waiting=64), NAME, codec)
    with ServerThread(app) as server:
        results = asyncio.run(_drive(server.url, jobs))
        after = wait_idle(server.url)
        assert_blocks_released_for(after)
        m = metrics(server.url)
    failures = [r for r in results if isinstance(r, BaseException)]
    assert failures == [], failures
    assert len(results) == REQUESTS
    for (kind, _, ids, max_tokens), tokens, (text, usage, finish) in zip(
            jobs, want, results, strict=True):
        assert usage.prompt_tokens == len(ids), kind
        assert usage.completion_tokens == max_tokens == len(tokens)
        assert finish == "length"
        assert text == hf.decode(tokens, skip_special_tokens=True), kind
    assert m.get('atombatch_requests_finished_total{reason="length"}') == REQUESTS
    assert 'atombatch_requests_rejected_total{status="400"}' not in m


def assert_blocks_released_for(m: dict[str, float]) -> None:
    blocks = {s: m[f'atombatch_blocks{{state="{s}"}}'] for s in
              ("free", "spare", "staged", "lane", "cached")}
    assert blocks["staged"] == 0 and blocks["lane"] == 0, blocks
    assert sum(blocks.values()) == ART.num_blocks


async def _drive(url: str, jobs: list[tuple[str, Any, list[int], int]]) -> list[Any]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                timeout=120)
    gate = asyncio.Semaphore(CONCURRENCY)
    options: Any = {"include_usage": True, "continuous_usage_stats": True}
    extra = {"ignore_eos": True, "stop": None, "top_p": None, "guidellm_request_id": "x"}

    async def one(job: tuple[str, Any, list[int], int]) -> tuple[str, Any, str | None]:
        kind, prompt, _, max_tokens = job
        async with gate:
            parts: list[str] = []
            usage = finish = None
            if kind == "chat":
                stream: Any = await client.chat.completions.create(
                    model=NAME, messages=prompt, max_tokens=max_tokens, temperature=0.0,
                    stream=True, stream_options=options, extra_body=extra)
                async for chunk in stream:
                    usage = chunk.usage or usage
                    if chunk.choices:
                        parts.append(chunk.choices[0].delta.content or "")
                        finish = chunk.choices[0].finish_reason or finish
            else:
                stream = await client.completions.create(
                    model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                    stream=True, stream_options=options, extra_body=extra)
                async for chunk in stream:
                    usage = chunk.usage or usage
                    if chunk.choices:
                        parts.append(chunk.choices[0].text)
                        finish = chunk.choices[0].finish_reason or finish
            return "".join(parts), usage, finish

    try:
        return await asyncio.gather(*(one(job) for job in jobs), return_exceptions=True)
    finally:
        await client.close()


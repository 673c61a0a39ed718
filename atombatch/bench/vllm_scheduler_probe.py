"""vLLM v1's own scheduler admitting requests, timed: the baseline of `bench micro`'s admission cases.

This file is run as a script by the Python of a separate virtual environment that holds vLLM
(`$ATOMBATCH_VLLM_PYTHON`, see docs/prefix-cache.md for how it is built), with `-P` so that
this directory (whose `http.py` would shadow the standard library's) is not on `sys.path`:
`$ATOMBATCH_VLLM_PYTHON -P atombatch/bench/vllm_scheduler_probe.py [--full 4:30000] ...`.
`bench micro` starts it with `subprocess` (`atombatch.bench.vllm_scheduler`) and reads the JSON
it prints. It imports vLLM, NumPy and the standard library
only, never atombatch, and it imports vLLM inside functions, so that this module can be linted
and its helpers imported where vLLM is absent.

What is built is vLLM's real `vllm.v1.core.sched.scheduler.Scheduler` with its real
`KVCacheManager` and `BlockPool`, as its `EngineCore` builds it, on a CPU-only `VllmConfig`: a
tiny Llama `config.json` written to a temporary directory (no download, no tokenizer, no model
weights, no worker), `DeviceConfig("cpu")`, one full-attention KV-cache group of 16-token blocks,
prefix caching on with its default hash (`sha256`), synchronous scheduling, `log_stats` as
`vllm serve` has it unless `--no-log-stats`. The model runner is replaced by what the scheduler
sees of it: a `ModelRunnerOutput` with one sampled token for every request whose prompt is
complete (`fake_output`). After setting up, the garbage collector's heap is frozen, as
`EngineCore` does after its start (`freeze_gc_heap`).

Cases (every figure is the median over repeats of the mean per admission, in ns, wall clock and
process CPU time):

- `hit`: an 8 192-token prompt whose every full block is cached (an identical request ran and
  finished before). One admission = `Request(...)` (its block hashes, computed at creation as
  vLLM does), `add_request`, the `schedule()` that admits it (511 blocks hit, the last 16 tokens
  scheduled), then `get_grammar_bitmask` + `update_from_output` of that step (its first token).
  Aborting it (its blocks back to the cache) and the steps after are untimed.
- `full`: B requests decoding at a full prefix cache that must evict: the pool
  (cached + B × max_model_len / 16 + 200 blocks, as `bench micro`'s `prefix_admit`) is
  filled with the cached blocks of finished 2 000-token requests until no free block is left
  that is not a cached one, so every block taken evicts one. One admission: a running request
  is aborted and one step runs (untimed), a new 128-token request (a miss) is created and added,
  and the step that admits it is timed (`schedule()`: its lookup, the evictions, its 128 tokens
  and the B − 1 decodes), beside a steady decode step of the same B requests. The per-request
  admission cost is the admitting step minus the steady one.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

BLOCK_SIZE = 16
TOKEN = 7  # every sampled token (ignore_eos: it never stops a request)
FILL_PROMPT = 2000  # the finished requests whose blocks fill the cache (as `full_cache_batcher`)
TINY_LLAMA = {  # a config.json ModelConfig can inspect; nothing of a model is ever loaded
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 1, "vocab_size": 32000, "max_position_embeddings": 65536,
    "rms_norm_eps": 1e-6, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}


class Clock:
    """Accumulates wall and process-CPU nanoseconds of the regions it times."""

    def __init__(self) -> None:
        self.wall = 0
        self.cpu = 0

    def time(self, call: Callable[..., Any], *args: Any) -> Any:
        wall, cpu = time.perf_counter_ns(), time.process_time_ns()
        out = call(*args)
        self.cpu += time.process_time_ns() - cpu
        self.wall += time.perf_counter_ns() - wall
        return out


def summary(samples: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """Medians (and the CPU range) of (wall ns, cpu ns) per-repeat means."""
    walls, cpus = [s[0] for s in samples], [s[1] for s in samples]
    return {"wall_ns": round(statistics.median(walls), 1),
            "cpu_ns": round(statistics.median(cpus), 1),
            "cpu_ns_range": [round(min(cpus), 1), round(max(cpus), 1)],
            "repeats": len(samples)}


def make_scheduler(max_model_len: int, num_blocks: int, max_num_seqs: int,
                   max_num_batched_tokens: int, log_stats: bool, workdir: str) -> Any:
    """vLLM's v1 `Scheduler` on a CPU-only config, the way `EngineCore.__init__` makes it."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(TINY_LLAMA, f)
    model = ModelConfig(model=workdir, skip_tokenizer_init=True, max_model_len=max_model_len,
                        dtype="float32")
    sched = SchedulerConfig(max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens,
                            max_model_len=max_model_len, is_encoder_decoder=False,
                            enable_chunked_prefill=True, async_scheduling=False)
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
    config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache,
                        device_config=DeviceConfig(device="cpu"))
    cache.num_gpu_blocks = num_blocks
    kv_cache = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1,
                                                      head_size=1, dtype=torch.float32))])
    return Scheduler(vllm_config=config, kv_cache_config=kv_cache,
                     structured_output_manager=StructuredOutputManager(config),
                     block_size=BLOCK_SIZE, log_stats=log_stats)


class Driver:
    """Requests in, steps out: what `EngineCore` does around its scheduler, with a model runner
    that samples `TOKEN` for every request whose prompt is complete."""

    def __init__(self, scheduler: Any) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        self.scheduler = scheduler
        algo = scheduler.cache_config.prefix_caching_hash_algo
        hash_fn = get_hash_fn_by_name(algo)
        init_none_hash(hash_fn)
        self.hash_algo = algo
        self.hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
        self.params = SamplingParams
        self.serial = 0

    def request(self, tokens: list[int], max_tokens: int) -> Any:
        """A `Request` as `EngineCore.add_request` makes one (block hashes computed)."""
        from vllm.v1.request import Request

        self.serial += 1
        params = self.params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return Request(request_id=f"r{self.serial}", prompt_token_ids=tokens,
                       sampling_params=params, pooling_params=None, block_hasher=self.hasher)

    def output(self, scheduled: Any) -> Any:
        """The model runner's output for a step: one token per request whose prompt is done."""
        from vllm.v1.outputs import ModelRunnerOutput

        ids = list(scheduled.num_scheduled_tokens)
        requests = self.scheduler.requests
        sampled = [[TOKEN] if requests[r].num_computed_tokens >= requests[r].num_tokens else []
                   for r in ids]
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=sampled)

    def finish(self, scheduled: Any) -> Any:
        """The rest of `EngineCore.step` after `schedule()`."""
        self.scheduler.get_grammar_bitmask(scheduled)
        return self.scheduler.update_from_output(scheduled, self.output(scheduled))

    def step(self) -> Any:
        scheduled = self.scheduler.schedule()
        self.finish(scheduled)
        return scheduled

    def abort(self, request_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    def cached_blocks(self) -> int:
        return len(self.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block)

    def cached_ids(self) -> set[int]:
        """The blocks holding a cached hash."""
        return {b.block_id for b in self.scheduler.kv_cache_manager.block_pool.blocks
                if b.block_hash is not None}

    def block_ids(self, request_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(request_id)[0])

    def uncached_free_blocks(self) -> int:
        """Free blocks that hold no cached hash (taking one evicts nothing)."""
        pool = self.scheduler.kv_cache_manager.block_pool
        return sum(1 for b in pool.free_block_queue.get_all_free_blocks()
                   if b.block_hash is None)


def _freeze() -> None:
    gc.collect()
    gc.freeze()  # EngineCore.__init__ -> freeze_gc_heap()


def hit_case(prompt_tokens: int, max_model_len: int, repeats: int, loops: int,
             log_stats: bool) -> dict[str, Any]:
    """Admitting a prompt whose every full block is cached (B = 1)."""
    import numpy as np

    with tempfile.TemporaryDirectory() as workdir:
        scheduler = make_scheduler(max_model_len, max_model_len // BLOCK_SIZE + 1, 1,
                                   max(8192, prompt_tokens), log_stats, workdir)
    driver = Driver(scheduler)
    prompt = np.random.default_rng(0).integers(1, 256, size=prompt_tokens).tolist()

    def run_to_end() -> None:
        while scheduler.has_requests():
            driver.step()
        driver.step()  # flushes the finished ids (an empty step)

    scheduler.add_request(driver.request(prompt, 1))
    run_to_end()
    expect = (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE  # vLLM recomputes the last token
    _freeze()
    parts = ("request", "add_request", "schedule", "finish")
    samples: dict[str, list[tuple[float, float]]] = {p: [] for p in parts}
    samples["add_request_schedule"] = []
    samples["step"] = []  # add_request + schedule + the rest of the step (not the Request)
    for _ in range(repeats):
        clocks = {p: Clock() for p in parts}
        for _ in range(loops):
            request = clocks["request"].time(driver.request, prompt, 16)
            clocks["add_request"].time(scheduler.add_request, request)
            scheduled = clocks["schedule"].time(scheduler.schedule)
            if request.num_computed_tokens - scheduled.num_scheduled_tokens[
                    request.request_id] != expect:
                raise RuntimeError(f"expected a hit of {expect} tokens, got "
                                   f"{request.num_cached_tokens}")
            clocks["finish"].time(driver.finish, scheduled)
            driver.abort(request.request_id)  # its blocks back to the cache (untimed)
            run_to_end()
        for p in parts:
            samples[p].append((clocks[p].wall / loops, clocks[p].cpu / loops))
        both = (clocks["add_request"], clocks["schedule"])
        samples["add_request_schedule"].append((sum(c.wall for c in both) / loops,
                                                sum(c.cpu for c in both) / loops))
        step = (clocks["add_request"], clocks["schedule"], clocks["finish"])
        samples["step"].append((sum(c.wall for c in step) / loops,
                                sum(c.cpu for c in step) / loops))
    return {"case": "hit", "lanes": 1, "prompt_tokens": prompt_tokens,
            "hit_tokens": expect, "num_blocks": max_model_len // BLOCK_SIZE + 1,
            "loops": loops, **{name: summary(s) for name, s in samples.items()}}


def full_case(lanes: int, cached: int, max_model_len: int, prompt_tokens: int, repeats: int,
              loops: int, log_stats: bool) -> dict[str, Any]:
    """B requests decoding at a full prefix cache; one new request admitted (a miss that
    evicts)."""
    import numpy as np

    num_blocks = cached + lanes * (max_model_len // BLOCK_SIZE) + 200
    with tempfile.TemporaryDirectory() as workdir:
        scheduler = make_scheduler(max_model_len, num_blocks, lanes, 8192, log_stats, workdir)
    driver = Driver(scheduler)
    rng = np.random.default_rng(0)
    started = time.perf_counter()
    while driver.uncached_free_blocks() > 0:  # every free block a cached one
        for _ in range(lanes):
            scheduler.add_request(driver.request(
                rng.integers(1, 256, size=min(FILL_PROMPT, max_model_len - 16)).tolist(), 1))
        while scheduler.has_requests():
            driver.step()
    fill_s = time.perf_counter() - started
    max_tokens = max_model_len - prompt_tokens - 8
    running: list[str] = []
    left = [0]

    def fresh() -> Any:
        return driver.request(rng.integers(1, 256, size=prompt_tokens).tolist(), max_tokens)

    def settle() -> None:
        while len(scheduler.running) < lanes or scheduler.waiting:
            driver.step()

    def renew() -> None:
        for request_id in running:
            driver.abort(request_id)
        driver.step()
        running[:] = []
        for _ in range(lanes):
            request = fresh()
            scheduler.add_request(request)
            running.append(request.request_id)
        settle()
        left[0] = max_tokens - 4

    renew()
    _freeze()
    names = ("admit_schedule", "admit_finish", "steady_schedule", "steady_finish")
    samples: dict[str, list[tuple[float, float]]] = {}
    evicted = []
    for _ in range(repeats):
        clocks = {n: Clock() for n in names}
        for _ in range(loops):
            if left[0] <= 8:
                renew()
            for _ in range(2):  # steady decode steps, every request decoding
                scheduled = clocks["steady_schedule"].time(scheduler.schedule)
                clocks["steady_finish"].time(driver.finish, scheduled)
            driver.abort(running.pop(0))
            driver.step()                  # drains the abort (untimed)
            request = fresh()              # hashed at creation (untimed, as bench micro's)
            running.append(request.request_id)
            before = driver.cached_ids()
            scheduler.add_request(request)
            scheduled = clocks["admit_schedule"].time(scheduler.schedule)
            clocks["admit_finish"].time(driver.finish, scheduled)
            if scheduled.num_scheduled_tokens.get(request.request_id) != prompt_tokens:
                raise RuntimeError("the admitting step did not schedule the new prompt")
            evicted.append(len(before & set(driver.block_ids(request.request_id))))
            left[0] -= 4
        for kind, count in (("admit", loops), ("steady", 2 * loops)):
            sched, rest = clocks[f"{kind}_schedule"], clocks[f"{kind}_finish"]
            samples.setdefault(f"{kind}_schedule", []).append(
                (sched.wall / count, sched.cpu / count))
            samples.setdefault(f"{kind}_step", []).append(
                ((sched.wall + rest.wall) / count, (sched.cpu + rest.cpu) / count))
    out = {n: summary(s) for n, s in samples.items()}
    for kind in ("schedule", "step"):
        extra = [(a[0] - s[0], a[1] - s[1]) for a, s in
                 zip(samples[f"admit_{kind}"], samples[f"steady_{kind}"], strict=True)]
        out[f"extra_{kind}"] = summary(extra)
    return {"case": "full", "lanes": lanes, "cached": cached, "num_blocks": num_blocks,
            "prompt_tokens": prompt_tokens, "max_model_len": max_model_len, "loops": loops,
            "fill_seconds": round(fill_s, 1),
            "cached_blocks_at_end": driver.cached_blocks(),
            "evicted_per_admission": statistics.median(evicted), **out}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="time vLLM v1's Scheduler admitting requests; JSON on stdout")
    parser.add_argument("--hit-tokens", type=int, default=8192,
                        help="the cached prompt of the hit case (0: skip it)")
    parser.add_argument("--hit-max-model-len", type=int, default=9216)
    parser.add_argument("--full", default="4:30000,16:30000",
                        help="comma-separated B:cached-blocks of the full-cache case "
                             "(empty: skip it)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--loops", type=int, default=20)
    parser.add_argument("--no-log-stats", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import vllm

    log_stats = not args.no_log_stats
    load_before = os.getloadavg()
    results = []
    if args.hit_tokens > 0:
        results.append(hit_case(args.hit_tokens, args.hit_max_model_len, args.repeats,
                                args.loops, log_stats))
        print("hit case done", file=sys.stderr)
    for item in [x for x in args.full.split(",") if x.strip()]:
        lanes, cached = (int(v) for v in item.split(":"))
        results.append(full_case(lanes, cached, args.max_model_len, args.prompt_tokens,
                                 args.repeats, args.loops, log_stats))
        print(f"full case B={lanes} done", file=sys.stderr)
    import torch

    json.dump({"vllm": vllm.__version__, "torch": torch.__version__,
               "python": platform.python_version(), "log_stats": log_stats,
               "hash_algo": "sha256", "load_before": [round(x, 2) for x in load_before],
               "load_after": [round(x, 2) for x in os.getloadavg()],
               "results": results}, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

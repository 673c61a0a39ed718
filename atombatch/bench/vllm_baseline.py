"""vLLM's own prefix-cache hashing and lookup, loaded from its source for the `micro` baseline.

`python -m atombatch.bench micro` compares the prefix index with vLLM v1's. When the environment
variable `ATOMBATCH_VLLM_SRC` names a directory holding the `vllm` package (an unpacked wheel:
`pip download vllm==0.33.0 --no-deps -d DIR && unzip DIR/vllm-*.whl -d DIR/src`; nothing of it is
installed or committed), the baseline runs vLLM's own functions from that source:
`vllm/utils/hashing.py` (`sha256`, the default `prefix_caching_hash_algo`: SHA-256 of the pickled
input), `vllm/v1/core/kv_cache_utils.py` (`init_none_hash`, `get_request_block_hasher`, which
calls `hash_block_tokens` once per full block and wraps each digest as a `BlockHash`) and
`vllm/v1/core/block_pool.py` (`BlockPool.cache_full_blocks` and `get_cached_block`, which packs
the group id into each key with `make_block_hash_with_group_id`). Their heavy imports (torch,
the config, the multimodal and metrics packages) are replaced by small stand-ins that the
hashing and lookup paths never call; `sys.modules` is restored afterwards. The lookup loop is
phase 1 of `FullAttentionManager.find_longest_cache_hit` (one `get_cached_block` per block
until the first miss), whose module cannot be imported without the model-runner packages.

Without the variable (or when the source cannot be loaded) the baseline is the same recipe
re-implemented (`recipe_hashes`), and the case says so in its shape name.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pickle
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV = "ATOMBATCH_VLLM_SRC"


@dataclass
class VllmPrefix:
    """vLLM's block hasher and block pool, or the recipe."""

    source: str                                   # "vllm <version>" or "recipe"
    hash_request: Callable[[list[int]], list[bytes]]   # a request's full-block hashes
    cache: Callable[[list[int]], Any]             # cache every full block of a prompt
    lookup: Callable[[list[bytes], Any], int]     # blocks of the longest cached run


def recipe_hashes(tokens: list[int], block_size: int, none_hash: bytes) -> list[bytes]:
    """vLLM v1's block hashes re-implemented: SHA-256 of the pickled (parent hash, tuple of the
    block's token ids, extra keys = None) per full block (`hash_block_tokens` with `sha256`)."""
    out, parent = [], none_hash
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hashlib.sha256(pickle.dumps(
            (parent, tuple(tokens[start:start + block_size]), None),
            protocol=pickle.HIGHEST_PROTOCOL)).digest()
        out.append(parent)
    return out


def recipe(block_size: int) -> VllmPrefix:
    """The recipe re-implemented (no vLLM source needed)."""
    none_hash = hashlib.sha256(pickle.dumps("vllm-none-hash",
                                            protocol=pickle.HIGHEST_PROTOCOL)).digest()

    def cache(tokens: list[int]) -> dict[bytes, int]:
        hashes = recipe_hashes(tokens, block_size, none_hash)
        return {h + (0).to_bytes(4, "big"): j for j, h in enumerate(hashes)}

    def lookup(hashes: list[bytes], table: dict[bytes, int]) -> int:
        hit = []
        for digest in hashes:  # the group id packed into each key, as vLLM does
            block = table.get(digest + (0).to_bytes(4, "big"))
            if block is None:
                break
            hit.append(block)
        return len(hit)

    return VllmPrefix("recipe", lambda t: recipe_hashes(t, block_size, none_hash), cache, lookup)


def _stub(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)

    def __getattr__(attr: str) -> Any:  # anything else: a placeholder class (never called)
        if attr.startswith("__"):
            raise AttributeError(attr)
        return type(attr, (), {})
    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    return module


@contextmanager
def _stand_ins(root: Path) -> Iterator[None]:
    """vLLM's packages as stand-ins, its real source for the modules loaded; `sys.modules` as it
    was afterwards."""
    import logging

    saved = dict(sys.modules)
    packages = ["vllm", "vllm.utils", "vllm.v1", "vllm.v1.core", "vllm.distributed"]
    for name in packages:
        package = types.ModuleType(name)
        package.__path__ = [str(root / name.replace(".", "/"))]
        sys.modules[name] = package
    sys.modules["cbor2"] = _stub("cbor2")  # only the *_cbor hashes use it
    sys.modules["vllm.envs"] = _stub("vllm.envs")
    sys.modules["vllm.config"] = _stub("vllm.config")
    sys.modules["vllm.logger"] = _stub("vllm.logger", init_logger=logging.getLogger)
    sys.modules["vllm.multimodal"] = _stub("vllm.multimodal")
    sys.modules["vllm.multimodal.utils"] = _stub("vllm.multimodal.utils")
    for name in ("vllm.v1.kv_cache_interface", "vllm.v1.kv_cache_spec_registry",
                 "vllm.v1.request", "vllm.v1.utils", "vllm.v1.core.kv_cache_metrics",
                 "vllm.v1.metrics", "vllm.v1.metrics.stats", "vllm.distributed.kv_events"):
        sys.modules[name] = _stub(name, MEDIUM_GPU="GPU", MEDIUM_CPU="CPU")
    try:
        yield
    finally:
        sys.modules.clear()
        sys.modules.update(saved)


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class _Request:
    """What vLLM's block hasher and `cache_full_blocks` read from a `vllm.v1.request.Request`."""

    def __init__(self, tokens: list[int]) -> None:
        self.request_id = "bench"
        self.all_token_ids = tokens
        self.num_tokens = len(tokens)
        self.block_hashes: list[bytes] = []
        self.mm_features: list[Any] = []
        self.lora_request = None
        self.cache_salt = None
        self.prompt_embeds = None
        self.kv_hints = None


def _version(root: Path) -> str:
    for info in root.glob("vllm-*.dist-info"):
        return info.name[len("vllm-"):-len(".dist-info")]
    text = (root / "vllm" / "_version.py")
    if text.exists():
        for line in text.read_text().splitlines():
            if line.startswith(("__version__", "version =")):
                return line.split("=")[-1].strip().strip("'\"")
    return "?"


def _vllm_modules(root: Path) -> tuple[Any, Any, Any]:
    """vLLM's hashing, kv_cache_utils and block_pool modules from its source under `root`
    (heavy imports stood in), its none-hash set up with sha256 (its default)."""
    with _stand_ins(root):
        hashing = _load("vllm.utils.hashing", root / "vllm/utils/hashing.py")
        _load("vllm.utils.math_utils", root / "vllm/utils/math_utils.py")
        utils = _load("vllm.v1.core.kv_cache_utils", root / "vllm/v1/core/kv_cache_utils.py")
        pool_module = _load("vllm.v1.core.block_pool", root / "vllm/v1/core/block_pool.py")
    utils.init_none_hash(hashing.sha256)
    return hashing, utils, pool_module


def _vllm(root: Path, block_size: int) -> VllmPrefix:
    hashing, utils, pool_module = _vllm_modules(root)
    hasher = utils.get_request_block_hasher(block_size, hashing.sha256)

    def hash_request(tokens: list[int]) -> list[bytes]:
        request = _Request(tokens)
        request.block_hashes = hasher(request)
        return request.block_hashes

    def cache(tokens: list[int]) -> Any:
        request = _Request(tokens)
        request.block_hashes = hasher(request)
        n = len(request.block_hashes)
        pool = pool_module.BlockPool(n + 1, True, block_size)
        blocks = pool.get_new_blocks(n)
        pool.cache_full_blocks(request, blocks, 0, n, block_size, 0)
        return pool

    def lookup(hashes: list[bytes], pool: Any) -> int:
        computed = []  # phase 1 of FullAttentionManager.find_longest_cache_hit
        for block_hash in hashes:
            cached = pool.get_cached_block(block_hash, [0])
            if not cached:
                break
            computed.append(cached[0])
        return len(computed)

    return VllmPrefix(f"vllm {_version(root)}", hash_request, cache, lookup)


def load(block_size: int) -> VllmPrefix:
    """vLLM's own code from `$ATOMBATCH_VLLM_SRC` when it loads, else the recipe."""
    source = os.environ.get(ENV)
    if source:
        try:
            return _vllm(Path(source), block_size)
        except Exception as exc:
            print(f"atombatch.bench: vLLM's code in {source} did not load ({exc!r}); "
                  "using the re-implemented recipe", file=sys.stderr)
    return recipe(block_size)


def admit_time_func(tokens: list[int], block_size: int, start_clocks: Callable[[], Any],
                    stop_clocks: Callable[[Any], float]) -> Callable[[int], float]:
    """The block-pool work of vLLM v1 admitting a prompt whose every full block is cached, on
    vLLM's own `BlockPool` (from `$ATOMBATCH_VLLM_SRC`): `get_computed_blocks` (phase 1 of
    `FullAttentionManager.find_longest_cache_hit`: one `get_cached_block` per block up to the
    last prompt token), `allocate_slots` (`touch` of the hit, `get_new_blocks` for the rest,
    `cache_full_blocks` of the newly full one). The hashes are computed when the request is
    made, as vLLM does, and untimed; so is finishing (`free_blocks`). The scheduler's own work
    around these calls (queues, `SchedulerOutput`, the block-id lists it sends) is not counted:
    a lower bound of vLLM's admission."""
    source = os.environ.get(ENV)
    if not source:
        raise RuntimeError(f"prefix_admit_hit_vllm needs ${ENV} (a directory holding vLLM's "
                           "source; see atombatch/bench/vllm_baseline.py)")
    root = Path(source)
    hashing, utils, pool_module = _vllm_modules(root)
    request = _Request(tokens)
    request.block_hashes = utils.get_request_block_hasher(block_size, hashing.sha256)(request)
    hashes, full = request.block_hashes, len(tokens) // block_size
    pool = pool_module.BlockPool(full + 2, True, block_size)
    blocks = pool.get_new_blocks(full)
    pool.cache_full_blocks(request, blocks, 0, full, block_size, 0)
    pool.free_blocks(reversed(blocks))
    limit = (len(tokens) - 1) // block_size  # vLLM recomputes at least the last prompt token

    def admit(loops: int) -> float:
        elapsed = 0.0
        for _ in range(loops):
            started = start_clocks()
            computed = []
            for block_hash in hashes[:limit]:
                cached = pool.get_cached_block(block_hash, [0])
                if not cached:
                    break
                computed.append(cached[0])
            pool.touch(computed)
            held = computed + pool.get_new_blocks(full - len(computed) + (len(tokens) % block_size > 0))
            pool.cache_full_blocks(request, held, len(computed), full, block_size, 0)
            elapsed += stop_clocks(started)
            if len(computed) != limit:
                raise RuntimeError("the vLLM admission baseline expected a full hit")
            pool.free_blocks(reversed(held))
        return elapsed
    return admit

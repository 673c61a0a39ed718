"""A short on-device check of an optimum-rbln compiled directory, for people with an ATOM.

`python -m atombatch.bench device --model DIR [--device N] [--new-tokens N] [--json PATH]`

It opens the directory with `RebelRuntime.from_optimum` and runs:

1. **B1 vs bucketed B{B}**: a probe prompt decodes alone (the smallest decode graph runs) and again
   beside B-1 other requests (the full batch graph); its greedy tokens must be equal.
2. **copy-block**: the probe is prefilled into blocks 0.., copied with the runtime's
   `_copy_kv_cache` over another prompt's KV, then decoded from the originals and from the copies
   (a hybrid model's sliding slot is saved and restored through `_fetch_kv_cache` /
   `_update_kv_cache`); tokens and logits must be equal.
3. **host round-trip**: the same with the blocks read to host memory and written back
   (`read_block` / `write_block`, the host cache's path).
4. **host time per step**: wall time of `Batcher.step` minus the time inside graph calls (median),
   beside the median graph call time per decode batch.
5. **LoRA rows** (a directory compiled with `lora_config`): the probe under each compiled adapter
   (and the base model) decodes alone, then all of them side by side in one decode call, each row
   with its own `lora_int_ids` entry; every adapter's tokens must be equal both ways (the device
   selects the adapter row by row). It also says how many adapters change the probe's tokens.

It prints a Markdown report to paste into an issue and exits 1 when a check fails. CI runs it
against the emulated runtime in `tests/fakerebel`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np

from atombatch.api.structs import SamplingParams
from atombatch.bench.provenance import git_commit, machine
from atombatch.engine.batcher import Batcher
from atombatch.errors import AtomBatchError
from atombatch.kernel.blocks import DecodeInputs, LaneTable, PrefillInputs
from atombatch.runtime.rebel import RebelRuntime


class Check(msgspec.Struct, frozen=True):
    """One line of the report."""

    name: str
    status: str            # "PASS" | "FAIL" | "SKIP" | "INFO"
    detail: str


class DeviceReport(msgspec.Struct, frozen=True):
    """Everything the check found, as printed and as JSON."""

    model_dir: str
    label: str
    identity: str
    decoder_batch_sizes: list[int]
    attn_impl: str
    cache_impl: str
    dtype: str
    logits_to_keep: int
    npu: str | None
    optimum_rbln_version: str | None
    rebel_version: str
    kv_methods: dict[str, bool]
    inputs: dict[str, list[str]]
    checks: list[Check]
    commit: str | None
    machine: str
    lora_adapters: list[str] = []      # "name (id k, r R, modules)" per compiled adapter

    @property
    def passed(self) -> bool:
        return all(c.status != "FAIL" for c in self.checks)


def probe_prompt(vocab: int, length: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(3, vocab, size=length).tolist()


class _Timed:
    """Wraps a runtime's graph calls to measure the time spent inside them."""

    def __init__(self, rt: RebelRuntime) -> None:
        self.rt = rt
        self.inside = 0.0
        self.decode_times: dict[int, list[float]] = {}
        self._prefill, self._decode = rt.prefill, rt.decode

        def prefill(inputs: Any, **options: Any) -> Any:  # every_position=...
            start = time.perf_counter()
            try:
                return self._prefill(inputs, **options)
            finally:
                self.inside += time.perf_counter() - start

        def decode(inputs: Any, **options: Any) -> Any:  # lora_int_ids=...
            start = time.perf_counter()
            try:
                return self._decode(inputs, **options)
            finally:
                spent = time.perf_counter() - start
                self.inside += spent
                self.decode_times.setdefault(int(inputs.input_ids.shape[0]), []).append(spent)

        rt.prefill, rt.decode = prefill, decode  # type: ignore[method-assign,assignment]

    def restore(self) -> None:
        self.rt.prefill, self.rt.decode = self._prefill, self._decode  # type: ignore[method-assign]


def check_buckets(rt: RebelRuntime, prompt_len: int, new_tokens: int) -> tuple[Check, Check]:
    """The probe alone vs among B-1 others; and the host time per step of the crowded run."""
    art = rt.artifact
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    probe = probe_prompt(art.model.vocab_size, prompt_len)
    others = [probe_prompt(art.model.vocab_size, prompt_len, seed=s)
              for s in range(1, art.batch_size)]
    before = dict(rt.decode_calls_by_batch)
    alone = Batcher(rt).generate([probe], params)[0]
    alone_graphs = {b: n - before[b] for b, n in rt.decode_calls_by_batch.items() if n > before[b]}
    timed = _Timed(rt)
    batcher = Batcher(rt)
    host_steps: list[float] = []
    try:
        ids = [batcher.submit(p, params) for p in [probe, *others]]
        finals: dict[str, Any] = {}
        while batcher.has_unfinished():
            inside, start = timed.inside, time.perf_counter()
            for out in batcher.step():
                if out.finished:
                    finals[out.request_id] = out
            host_steps.append(time.perf_counter() - start - (timed.inside - inside))
    finally:
        timed.restore()
    crowded = finals[ids[0]].completion
    errors = [o.error for o in finals.values() if o.finish_reason == "error"]
    graphs = ", ".join(f"decoder_batch_{b} x{n}" for b, n in sorted(alone_graphs.items()))
    if alone.finish_reason == "error" or errors:
        bucket = Check(f"B1 vs bucketed B{art.batch_size}", "FAIL",
                       f"a request failed: {alone.error or errors[0]}")
    elif list(alone.token_ids) == list(crowded.token_ids):
        bucket = Check(f"B1 vs bucketed B{art.batch_size}", "PASS",
                       f"probe's {new_tokens} greedy tokens equal alone ({graphs}) and beside "
                       f"{art.batch_size - 1} others")
    else:
        first = next(i for i, (a, b) in enumerate(zip(alone.token_ids, crowded.token_ids,
                                                      strict=True)) if a != b)
        bucket = Check(f"B1 vs bucketed B{art.batch_size}", "FAIL",
                       f"tokens differ from step {first}: alone {list(alone.token_ids)}, "
                       f"crowded {list(crowded.token_ids)}")
    calls = "; ".join(f"decoder_batch_{b} median {statistics.median(t) * 1e3:.2f} ms "
                      f"({len(t)} calls)" for b, t in sorted(timed.decode_times.items()))
    host = statistics.median(host_steps) * 1e6 if host_steps else 0.0
    timing = Check("host time per step", "INFO",
                   f"median {host:.0f} us of host work per Batcher.step ({len(host_steps)} "
                   f"steps); graph calls: {calls}")
    return bucket, timing


def check_kv_moves(rt: RebelRuntime, prompt_len: int, new_tokens: int) -> list[Check]:
    """Prefill a probe into blocks 0.. and decode from it; then decode from a device copy of its
    blocks (`copy_block`) and from a host round trip of them (`read_block` / `write_block`),
    each written over another prompt's KV first: tokens and logits must equal the original's."""
    art, spec = rt.artifact, rt.spec
    names = ("copy-block", "host round-trip")
    bps, size = art.blocks_per_seq, art.block_size
    chunk = art.prefill_chunk_size
    padded = -(-prompt_len // chunk) * chunk              # the last chunk's padding is written too
    span = -(-max(padded, prompt_len + new_tokens) // size)   # blocks the probe reaches
    padding_rows = min(rt.decoder_batch_sizes) > 1
    needed = 2 * span + int(padding_rows)
    if art.num_blocks < needed:
        reason = f"needs {needed} blocks, the directory has kvcache_num_blocks={art.num_blocks}"
        return [Check(name, "SKIP", reason) for name in names]
    source = list(range(span))
    copies = list(range(span, 2 * span))
    pad_block = 2 * span if padding_rows else 0
    probe = probe_prompt(spec.vocab_size, prompt_len)
    other = probe_prompt(spec.vocab_size, prompt_len, seed=99)
    inputs = PrefillInputs(chunk, bps)

    def prefill(prompt: list[int], row: list[int]) -> int:
        logits = None
        for start in range(0, prompt_len, chunk):
            inputs.build(np.asarray(prompt), start, np.asarray(row, dtype=np.int32), len(row), 0)
            logits = rt.prefill(inputs)
        assert logits is not None
        return int(np.argmax(logits))

    def decode(row: list[int]) -> tuple[list[int], np.ndarray]:
        for layer, (k, v) in snapshot:       # the probe's sliding slot as the prefill left it
            rt.write_layer_kv(layer, k, v, [], slot=0)
        return _decode_alone(rt, row, pad_block, first, prompt_len, new_tokens)

    def compare(name: str, detail: str, run: tuple[list[int], np.ndarray]) -> Check:
        delta = float(np.max(np.abs(original[1] - run[1])))
        detail = f"{detail}, {new_tokens} decode steps: max |dlogit| = {delta:.3g}"
        if original[0] != run[0]:
            return Check(name, "FAIL", f"{detail}; tokens differ: {original[0]} vs {run[0]}")
        return Check(name, "PASS" if delta == 0.0 else "FAIL", detail)

    try:
        prefill(other, copies)
        first = prefill(probe, source)
        snapshot = [(layer, rt.read_layer_kv(layer, [], prompt_len, slot=0))
                    for layer in spec.sliding_layers]
        original = decode(source)
    except (AtomBatchError, RuntimeError, ValueError) as exc:
        return [Check(name, "FAIL", f"{type(exc).__name__}: {exc}") for name in names]
    checks = []
    try:
        for src, dst in zip(source, copies, strict=True):
            rt.copy_block(src, dst)
        checks.append(compare(names[0], f"blocks {source} -> {copies} on the device",
                              decode(copies)))
    except (AtomBatchError, RuntimeError, ValueError) as exc:
        checks.append(Check(names[0], "FAIL", f"{type(exc).__name__}: {exc}"))
    try:
        prefill(other, copies)
        saved = [rt.read_block(block) for block in source]
        for dst, data in zip(copies, saved, strict=True):
            rt.write_block(dst, data)
        checks.append(compare(names[1], f"blocks {source} -> host -> {copies}", decode(copies)))
    except (AtomBatchError, RuntimeError, ValueError) as exc:
        checks.append(Check(names[1], "FAIL", f"{type(exc).__name__}: {exc}"))
    return checks


def check_lora_rows(rt: RebelRuntime, prompt_len: int, new_tokens: int) -> Check | None:
    """Each compiled adapter's probe tokens decoded alone vs side by side with the others (one
    adapter per row of one decode call); None when the directory has no LoRA."""
    adapters = getattr(rt, "lora_adapters", None)
    if not adapters:
        return None
    art = rt.artifact
    bps = art.blocks_per_seq
    lanes_fit = min(art.batch_size, (art.num_blocks - 1) // bps)
    if lanes_fit < 1:
        return Check("LoRA rows", "SKIP", f"kvcache_num_blocks={art.num_blocks} leaves no "
                     "padding block beside a full sequence")
    ids = [0, *sorted(a.lora_int_id for a in adapters.values())]
    probe = probe_prompt(art.model.vocab_size, prompt_len)
    try:
        alone = {k: _lora_lanes(rt, probe, [k], new_tokens)[0] for k in ids}
        together: dict[int, list[int]] = {}
        for start in range(0, len(ids), lanes_fit):
            group = ids[start : start + lanes_fit]
            together.update(zip(group, _lora_lanes(rt, probe, group, new_tokens), strict=True))
    except AtomBatchError as exc:
        return Check("LoRA rows", "FAIL", f"a call failed: {exc}")
    differ = [k for k in ids if alone[k] != together[k]]
    moved = sum(1 for k in ids[1:] if alone[k] != alone[0])
    if differ:
        return Check("LoRA rows", "FAIL",
                     f"adapter ids {differ} give other tokens beside the others than alone "
                     f"(first: alone {alone[differ[0]]}, together {together[differ[0]]})")
    return Check("LoRA rows", "PASS",
                 f"{len(ids) - 1} adapters and the base: each one's {new_tokens} greedy tokens "
                 f"equal alone and side by side ({lanes_fit} rows per call); {moved} of "
                 f"{len(ids) - 1} adapters change the probe's tokens")


def _lora_lanes(rt: RebelRuntime, prompt: list[int], lora_ids: list[int], new_tokens: int
                ) -> list[list[int]]:
    """`prompt` greedily decoded in lanes 0..n-1, lane i under adapter `lora_ids[i]`: lane i
    holds blocks i*bps.., the last block is every padding row's; padding rows run the base."""
    art = rt.artifact
    bps = art.blocks_per_seq
    lanes = LaneTable(art.batch_size, bps, art.block_size)
    prefill = PrefillInputs(art.prefill_chunk_size, bps)
    decode = DecodeInputs(art.batch_size, bps, art.decoder_batch_sizes)
    by_lane = np.zeros(art.batch_size, dtype=np.int32)
    spare = art.num_blocks - 1
    tokens: dict[int, list[int]] = {}
    for k in lora_ids:
        lane = lanes.assign()
        lanes.push_blocks(lane, np.arange(lane * bps, (lane + 1) * bps, dtype=np.int32))
        by_lane[lane] = k
        row = np.asarray(lanes.blocks(lane), dtype=np.int32)
        logits = None
        for start in range(0, len(prompt), art.prefill_chunk_size):
            prefill.build(np.asarray(prompt), start, row, len(row), lane)
            logits = rt.prefill(prefill, lora_int_ids=np.array([k], dtype=np.int32))
        assert logits is not None
        tokens[lane] = [int(np.argmax(logits))]
        lanes.start_decode(lane, len(prompt), tokens[lane][0])
    for _ in range(new_tokens - 1):
        decoding = decode.build(lanes, spare)
        ids = np.zeros(decode.num_rows, dtype=np.int32)
        ids[:decoding] = by_lane[decode.row_lanes[:decoding]]
        out = rt.decode(decode, lora_int_ids=ids)
        for r in range(decoding):
            lane = int(decode.row_lanes[r])
            tokens[lane].append(int(np.argmax(out[r])))
            lanes.advance(lane, tokens[lane][-1])
    return [tokens[lane] for lane in range(len(lora_ids))]


def _decode_alone(rt: RebelRuntime, row: list[int], pad_block: int, token: int, position: int,
                  steps: int) -> tuple[list[int], np.ndarray]:
    """Decode one sequence (lane 0, slot 0) in the smallest decode graph; padding rows point at
    `pad_block` and at slots of no live sequence."""
    art = rt.artifact
    b = min(rt.decoder_batch_sizes)
    bps = art.blocks_per_seq
    inputs = SimpleNamespace(
        input_ids=np.zeros((b, 1), np.int64), cache_position=np.zeros((b, 1), np.int32),
        block_tables=np.full((b, bps), pad_block, np.int16),
        local_block_tables=np.arange(b, dtype=np.int16).reshape(b, 1))
    table = [row[min(j, len(row) - 1)] for j in range(bps)]
    inputs.block_tables[0] = table
    tokens, rows = [], []
    for _ in range(steps):
        inputs.input_ids[0, 0] = token
        inputs.cache_position[0, 0] = position
        logits = rt.decode(inputs)[0]
        rows.append(logits)
        token = int(np.argmax(logits))
        tokens.append(token)
        position += 1
    return tokens, np.stack(rows)


def run(model_dir: str, device: int | list[int] = 0, prompt_len: int = 0,
        new_tokens: int = 16) -> DeviceReport:
    rt = RebelRuntime.from_optimum(model_dir, device=device)
    art = rt.artifact
    if not prompt_len:
        prompt_len = min(art.prefill_chunk_size + art.prefill_chunk_size // 2,
                         art.max_seq_len - new_tokens - 1)
    bucket, timing = check_buckets(rt, prompt_len, new_tokens)
    moves = check_kv_moves(rt, prompt_len, new_tokens)
    lora = check_lora_rows(rt, prompt_len, new_tokens)
    compiled = rt.compiled
    graphs = [compiled.prefill, *compiled.decoders]
    return DeviceReport(
        model_dir=str(model_dir), label=art.label, identity=art.identity,
        decoder_batch_sizes=list(rt.decoder_batch_sizes), attn_impl=compiled.attn_impl,
        cache_impl=compiled.cache_impl, dtype=compiled.dtype,
        logits_to_keep=compiled.logits_to_keep, npu=compiled.npu,
        optimum_rbln_version=compiled.optimum_rbln_version, rebel_version=rt.version,
        kv_methods=dict(rt.kv_methods),
        inputs={g.name: [f"{i.name} {list(i.shape)} {i.dtype}" for i in g.inputs]
                for g in graphs},
        checks=[bucket, *moves, *([lora] if lora else []), timing], commit=git_commit(),
        machine=machine(),
        lora_adapters=[f"{a.name} (id {a.lora_int_id}, r {a.r}, {', '.join(a.target_modules)})"
                       for a in getattr(rt, "lora_adapters", {}).values()])


def format_report(report: DeviceReport) -> str:
    kv = ", ".join(f"{name} {'yes' if ok else 'MISSING'}" for name, ok in report.kv_methods.items())
    lines = [
        "### atombatch device check",
        "",
        f"- directory: `{report.model_dir}` ({report.label}, identity {report.identity})",
        f"- decoder_batch_sizes {report.decoder_batch_sizes}, attn_impl {report.attn_impl}, "
        f"cache_impl {report.cache_impl}, dtype {report.dtype}, "
        f"logits_to_keep {report.logits_to_keep}, npu {report.npu}",
        f"- optimum-rbln {report.optimum_rbln_version}, rebel-sdk {report.rebel_version}, "
        f"atombatch {report.commit}, {report.machine}",
        f"- KV methods: {kv}",
        *([f"- LoRA adapters: {'; '.join(report.lora_adapters)}"] if report.lora_adapters
          else []),
        "",
        "| check | result | detail |",
        "|---|---|---|",
    ]
    lines += [f"| {c.name} | {c.status} | {c.detail} |" for c in report.checks]
    lines += ["", "Graph inputs (positional order):", ""]
    lines += [f"- `{name}`: " + ", ".join(items) for name, items in report.inputs.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m atombatch.bench device",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a directory compiled by optimum-rbln")
    p.add_argument("--device", default="0", help="ATOM device index, or a comma list (TP)")
    p.add_argument("--prompt-len", type=int, default=0,
                   help="probe prompt tokens (default: 1.5 prefill chunks)")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--json", help="also write the report as JSON to this path")
    args = p.parse_args(argv)
    devices = [int(d) for d in str(args.device).split(",")]
    try:
        report = run(args.model, devices[0] if len(devices) == 1 else devices,
                     args.prompt_len, args.new_tokens)
    except AtomBatchError as exc:
        print(f"atombatch.bench device: {exc}", file=sys.stderr)
        return 2
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(msgspec.to_builtins(report), f, indent=2)
    return 0 if report.passed else 1

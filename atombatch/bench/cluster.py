"""`python -m atombatch.bench cluster`: many ATOMs behind a router, on the simulator.

Each decode replica is a real `Batcher` (prefix cache on, `--prefix-cache off|both` to compare;
hybrid models keep sliding-slot checkpoints in a `--host-cache-gib` host cache) on its own
`SimRuntime`, the device-time model `bench serve` uses; a router in front of them applies one of
the policies of `atombatch.cluster` (the same classes the Ray Serve router runs). With
`--producers M` every request is prefilled by one of M simulated PD producers, chosen by load
(the producer whose queue empties first), and decoded by the replica the router picks.

    python -m atombatch.bench cluster                          # koni-8b, shared-prefix chat
    python -m atombatch.bench cluster --models koni-8b,qwen3-4b --replicas 1,2,4,8 \\
        --rates 0.5,1,2,4 --policies pow2,prefix --json cluster.json
    python -m atombatch.bench cluster --size --slo-ttft 2 --rates 4   # ATOMs for a load and SLO
    python -m atombatch.bench cluster --models gemma3-1b --replicas 1 --policies prefix \
        --prefix-cache both --turns 4                       # multi-turn TTFT with vs without cache
    python -m atombatch.bench cluster --ray --replicas 2 --conversations 24 --turns 3 \
        --system-len 512 --user-len 64 --output-len 16     # real Ray Serve: vs its default router

Workload ("chat"): conversations arrive as a Poisson process (`--rates`, conversations/s); each
opens with one of `--system-prompts` shared system prompts (`--system-len` tokens), then runs
`--turns` turns: a user message of `--user-len` tokens, an answer of `--output-len` tokens, a think
time (exponential, mean `--think-s`) and the next turn, whose prompt is the whole conversation so
far. Requests per second = rate x turns. This is the case prefix affinity is for: every turn
shares the system prompt with every conversation and its own history with the turn before.

Time: one virtual clock per replica (each `SimRuntime`); the loop always steps the replica whose
clock is earliest and delivers an arrival once every busy replica's clock has reached it, so the
router sees each replica's state as of the end of its last step. Idle replicas jump to the arrival.

Reported per cell: prefix hit rate (prompt tokens whose prefill a replica's cache saved / prompt
tokens), TTFT p50/p99, time per output token p99, output tok/s, requests per replica (spread), and
whether the cell meets the SLO (`--slo-ttft`, `--slo-tpot` on the p99s, every request finished).
`--size` answers "how many ATOMs for this load and SLO": for each model, rate and policy, the
fewest replicas of the list that meet it (ATOMs = replicas x tensor parallel + producers).
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from atombatch.api.structs import Completion, SamplingParams
from atombatch.artifact.config import ModelSpec
from atombatch.bench import provenance
from atombatch.bench.progress import CellProgress
from atombatch.bench.serve import fit_verdict, parse_artifact
from atombatch.cluster import PrefixAffinityPolicy, ReplicaLoad, make_policy, route_digests
from atombatch.cluster.summary import CacheSummarizer
from atombatch.engine.batcher import Batcher
from atombatch.errors import AtomBatchError, ConfigError
from atombatch.runtime.sim import CostModel, SimKVSource, SimProducer, SimRuntime

MODELS = ("qwen3-0.6b", "qwen3-4b", "koni-8b", "gemma3-1b")
# The KV bytes of B4/k5 at context 9216 (5 x 9216 tokens), in 256-token blocks: a sequence takes
# only the blocks its tokens need, so the rest holds cached prefixes. KONI B4 does not fit one
# device (see `bench fit`): its replicas are two ATOMs each (tensor parallel 2).
ARTIFACT = "B4/k180/bs256"
ARTIFACTS = {"koni-8b": "B4/k180/bs256/tp2"}
CONTEXT = 9216
CHUNK = 128
POLICIES = ("pow2", "prefix")
# A hybrid replica's host cache by default: its prefix cache keeps sliding-slot checkpoints there
# (gemma3-1b: 11 MiB each, docs/prefix-cache.md), 2 GiB holds about 180 of them.
HYBRID_HOST_CACHE_BYTES = 2 << 30


class Workload(msgspec.Struct, frozen=True):
    """The shared-prefix chat workload (see the module docstring)."""

    rate: float = 1.0                   # conversations per second (Poisson)
    conversations: int = 64
    turns: int = 4
    system_prompts: int = 4             # distinct shared system prompts
    system_len: int = 1024
    user_len: int = 128
    output_len: int = 128
    think_s: float = 5.0                # mean think time between turns (exponential)
    seed: int = 0

    @property
    def max_prompt_len(self) -> int:
        return self.system_len + self.turns * self.user_len + (self.turns - 1) * self.output_len


class Latency(msgspec.Struct, frozen=True):
    p50: float | None
    p99: float | None
    max: float | None


class ClusterCell(msgspec.Struct, frozen=True):
    """One model x artifact x replicas x producers x policy x rate, and what it measured."""

    model: str
    artifact: str
    replicas: int
    producers: int
    policy: str
    rate: float                          # conversations / s
    request_rate: float                  # requests / s (rate x turns)
    atoms: int                           # replicas x tensor parallel + producers
    status: str                          # "ok" | "rejected" | "error"
    error: str | None = None
    prefix_cache: bool = False           # the replicas' prefix cache (hybrid: with checkpoints)
    host_cache_bytes: int = 0            # each replica's host cache (blocks and checkpoints)
    slot_restores: int = 0               # hybrid: sliding-slot checkpoints restored on hits
    requests: int = 0
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_hit_rate: float = 0.0         # prefix_hit_tokens / prompt_tokens
    ttft: Latency | None = None
    tpot: Latency | None = None          # (e2e - ttft) / (tokens - 1)
    output_tok_s: float = 0.0
    makespan_s: float = 0.0
    per_replica: tuple[int, ...] = ()    # requests each replica served
    spilled: int = 0                     # affinity overridden by the imbalance bound
    meets_slo: bool = False
    wall_s: float = 0.0


class ClusterReport(msgspec.Struct):
    command: str
    provenance: Any
    costs: str
    slo_ttft_s: float
    slo_tpot_s: float
    workload: Workload
    cells: list[ClusterCell]
    sizing: list[dict[str, Any]] = []


def _latency(values: Sequence[float]) -> Latency | None:
    if not values:
        return None
    a = np.asarray(values, dtype=np.float64)
    return Latency(p50=float(np.percentile(a, 50)), p99=float(np.percentile(a, 99)),
                   max=float(a.max()))


class _Conversation:
    def __init__(self, index: int, system: np.ndarray, users: list[np.ndarray]) -> None:
        self.index = index
        self.history = system.copy()
        self.users = users
        self.turn = 0


class _Pool:
    """A simulated PD producer serving several decoders: one compute queue and one link, with a
    `SimProducer` per decoder (its clock and pseudo-logits) sharing that timeline."""

    def __init__(self, name: str, mode: str) -> None:
        self.name = name
        self.mode = mode
        self.free_at = 0.0
        self.link_free_at = 0.0
        self.busy_s = 0.0
        self.requests = 0
        self._views: dict[int, SimProducer] = {}

    def view(self, sim: SimRuntime) -> SimProducer:
        view = self._views.get(id(sim))
        if view is None:
            view = self._views[id(sim)] = SimProducer(sim, self.mode)  # type: ignore[arg-type]
        return view

    def source(self, sim: SimRuntime, request_id: str, prompt: np.ndarray,
               params: SamplingParams, arrival: float) -> SimKVSource:
        view = self.view(sim)
        view.free_at, view.link_free_at = self.free_at, self.link_free_at
        busy = view.busy_s
        source = view.source(request_id, prompt, params, arrival=arrival)
        self.free_at, self.link_free_at = view.free_at, view.link_free_at
        self.busy_s += view.busy_s - busy
        self.requests += 1
        return source


class _Replica:
    def __init__(self, name: str, sim: SimRuntime, batcher: Batcher) -> None:
        self.name = name
        self.sim = sim
        self.batcher = batcher
        self.in_flight: dict[str, tuple[_Conversation, float, int]] = {}
        self.served = 0
        self.views: list[SimProducer] = []

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(self.name, lanes=self.batcher.artifact.batch_size,
                           in_flight=len(self.in_flight),
                           prefix_cache=self.batcher.scheduler.prefix is not None)

    def next_producer_event(self) -> float | None:
        events = [e for e in (v.next_event() for v in self.views) if e is not None]
        return min(events) if events else None


def run_cell(model: str, replicas: int, policy_name: str, workload: Workload, *,
             producers: int = 0, artifact_spec: str | None = None, context: int = CONTEXT,
             chunk: int = CHUNK, costs: CostModel | None = None, slo_ttft: float = 2.0,
             slo_tpot: float = 0.2, max_imbalance: int = 4,
             pd_mode: str = "layer-stream", report_s: float | None = 0.5,
             pending_s: float | None = None, prefix_cache: bool = True,
             host_cache_bytes: int | None = None) -> ClusterCell:
    """Simulate one cell (see the module docstring). `report_s`: how often replicas report a
    summary of their prefix cache to the router (None: never; the router knows only where it
    sent what); `pending_s`: the router's window for its own sends (default the policy's).
    `host_cache_bytes`: each replica's host cache; None: none, except `HYBRID_HOST_CACHE_BYTES`
    for a hybrid model (its prefix cache keeps sliding-slot checkpoints there)."""
    wall = time.perf_counter()
    spec = ModelSpec.preset(model)
    artifact_spec = artifact_spec or ARTIFACTS.get(model, ARTIFACT)
    fields, built = parse_artifact(artifact_spec, spec, context, chunk)
    tp = fields["tensor_parallel"]
    base: dict[str, Any] = dict(model=model, artifact=artifact_spec, replicas=replicas,
                                producers=producers, policy=policy_name, rate=workload.rate,
                                request_rate=workload.rate * workload.turns,
                                atoms=replicas * tp + producers)
    if isinstance(built, str):
        return ClusterCell(status="rejected", error=built, **base)
    artifact = built
    if workload.max_prompt_len + workload.output_len > artifact.max_seq_len:
        return ClusterCell(status="rejected", error=f"a conversation reaches "
                           f"{workload.max_prompt_len + workload.output_len} tokens, over "
                           f"max_seq_len={artifact.max_seq_len}", **base)
    if fit_verdict(artifact).fits is False:
        return ClusterCell(status="rejected", error="the artifact does not fit one device",
                           **base)
    costs = costs or CostModel.default()
    if host_cache_bytes is None:
        host_cache_bytes = HYBRID_HOST_CACHE_BYTES if spec.is_hybrid and prefix_cache else 0
    if not prefix_cache:
        host_cache_bytes = 0
    policy = make_policy(policy_name, seed=workload.seed, max_imbalance=max_imbalance)
    if isinstance(policy, PrefixAffinityPolicy) and pending_s is not None:
        policy.pending_s = pending_s
    # the replicas report their caches every `report_s` (as `record_routing_stats` does on Ray
    # Serve); None: the policy knows only where it sent what
    summarizers = {f"r{i}": CacheSummarizer() for i in range(replicas)} \
        if report_s is not None and prefix_cache else {}
    reported_at: dict[str, float] = {}
    digests_of: dict[str, tuple[bytes, ...]] = {}
    fleet = []
    for i in range(replicas):
        sim = SimRuntime(artifact, costs, seed=0)
        try:
            batcher = Batcher(sim, prefix_cache=prefix_cache, host_cache_bytes=host_cache_bytes,
                              pd_timeout=math.inf)
        except ConfigError as exc:
            return ClusterCell(status="rejected", error=str(exc), prefix_cache=prefix_cache,
                               host_cache_bytes=host_cache_bytes, **base)
        fleet.append(_Replica(f"r{i}", sim, batcher))
    pools = [_Pool(f"p{i}", pd_mode) for i in range(producers)]
    params = SamplingParams(max_tokens=workload.output_len, temperature=0.0, ignore_eos=True)

    rng = np.random.default_rng(workload.seed)
    vocab = spec.vocab_size
    systems = [rng.integers(3, vocab, workload.system_len, dtype=np.int64)
               for _ in range(workload.system_prompts)]
    arrivals: list[tuple[float, int, _Conversation]] = []
    when = 0.0
    for c in range(workload.conversations):
        when += float(rng.exponential(1.0 / workload.rate))
        conv = _Conversation(c, systems[c % workload.system_prompts],
                             [rng.integers(3, vocab, workload.user_len, dtype=np.int64)
                              for _ in range(workload.turns)])
        heapq.heappush(arrivals, (when, c, conv))
    think = np.random.default_rng(workload.seed + 1)

    ttfts: list[float] = []
    tpots: list[float] = []
    prompt_tokens = tokens_out = failed = 0
    first_arrival = arrivals[0][0] if arrivals else 0.0
    last_finish = first_arrival
    next_id = 0

    def deliver(replica: _Replica, completion: Completion) -> None:
        nonlocal failed, tokens_out, last_finish
        conv, arrived, _ = replica.in_flight.pop(completion.request_id)
        timings = completion.timings
        digests = digests_of.pop(completion.request_id, ())
        if timings is not None:
            policy.completed(digests, replica.name, timings.finished)
        if completion.finish_reason not in ("stop", "length") or timings is None:
            failed += 1
            return
        ttft = timings.first_token - arrived
        ttfts.append(ttft)
        n = len(completion.token_ids)
        tokens_out += n
        if n > 1:
            tpots.append((timings.finished - timings.first_token) / (n - 1))
        last_finish = max(last_finish, timings.finished)
        conv.history = np.concatenate([conv.history,
                                       np.asarray(completion.token_ids, dtype=np.int64)])
        conv.turn += 1
        if conv.turn < workload.turns:
            heapq.heappush(arrivals, (timings.finished + float(think.exponential(
                workload.think_s)), conv.index, conv))

    try:
        while True:
            t_next = arrivals[0][0] if arrivals else math.inf
            busy = [r for r in fleet if r.batcher.has_unfinished()]
            if not busy and not arrivals:
                break
            replica = min(busy, key=lambda r: r.sim.clock()) if busy else None
            if replica is not None and replica.sim.clock() < t_next:
                before = (replica.batcher.scheduler.counters.steps, replica.sim.clock())
                outputs = replica.batcher.step()
                for out in outputs:
                    if out.finished and out.completion is not None:
                        deliver(replica, out.completion)
                if not outputs and (replica.batcher.scheduler.counters.steps,
                                    replica.sim.clock()) == before:
                    wake = replica.next_producer_event()
                    if wake is None and t_next == math.inf:
                        raise AtomBatchError(f"replica {replica.name} has work but schedules "
                                             "nothing")
                    replica.sim.advance_to(min(wake if wake is not None else math.inf, t_next))
                continue
            when, _, conv = heapq.heappop(arrivals)
            for r in fleet:
                if not r.batcher.has_unfinished():
                    r.sim.advance_to(when)
            prompt = np.concatenate([conv.history, conv.users[conv.turn]])
            conv.history = prompt
            digests = route_digests(prompt)
            for r in fleet:
                if r.name in summarizers and when - reported_at.get(r.name, -math.inf) >= \
                        (report_s or 0.0):
                    policy.report(r.name, summarizers[r.name].summary(
                        r.batcher.scheduler.prefix, r.batcher.scheduler.host))
                    reported_at[r.name] = when
            chosen_name = policy.choose(digests, [r.load() for r in fleet], when)
            chosen = next(r for r in fleet if r.name == chosen_name)
            rid = f"c{conv.index}t{conv.turn}n{next_id}"
            next_id += 1
            kv = None
            if pools:
                pool = min(pools, key=lambda p: (p.free_at, p.requests))
                kv = pool.source(chosen.sim, rid, prompt, params, arrival=when)
                view = pool.view(chosen.sim)
                if view not in chosen.views:
                    chosen.views.append(view)
            chosen.batcher.submit(prompt, params, request_id=rid, kv=kv)
            digests_of[rid] = digests
            chosen.in_flight[rid] = (conv, when, len(prompt))
            chosen.served += 1
            prompt_tokens += len(prompt)
    except Exception as exc:  # reported, the sweep goes on
        return ClusterCell(status="error", error=f"{type(exc).__name__}: {exc}",
                           prefix_cache=prefix_cache, host_cache_bytes=host_cache_bytes,
                           wall_s=time.perf_counter() - wall, **base)

    stats = [r.batcher.stats() for r in fleet]
    hit_tokens = sum(s.prefix_hit_tokens for s in stats)
    requests = sum(r.served for r in fleet)
    makespan = last_finish - first_arrival
    ttft, tpot = _latency(ttfts), _latency(tpots)
    meets = (failed == 0 and ttft is not None and ttft.p99 is not None and ttft.p99 <= slo_ttft
             and (tpot is None or (tpot.p99 is not None and tpot.p99 <= slo_tpot)))
    return ClusterCell(
        status="ok", prefix_cache=prefix_cache, host_cache_bytes=host_cache_bytes,
        slot_restores=sum(s.slot_restores for s in stats), requests=requests,
        completed=len(ttfts),
        failed=failed, prompt_tokens=prompt_tokens, prefix_hit_tokens=hit_tokens,
        prefix_hit_rate=hit_tokens / prompt_tokens if prompt_tokens else 0.0, ttft=ttft,
        tpot=tpot, output_tok_s=tokens_out / makespan if makespan > 0 else 0.0,
        makespan_s=makespan, per_replica=tuple(r.served for r in fleet),
        spilled=policy.stats.spilled, meets_slo=bool(meets),
        wall_s=time.perf_counter() - wall, **base)


def size(cells: Sequence[ClusterCell]) -> list[dict[str, Any]]:
    """For each model, rate, producers and policy: the fewest ATOMs whose cell met the SLO."""
    groups: dict[tuple[str, float, int, str, bool], list[ClusterCell]] = {}
    for cell in cells:
        groups.setdefault((cell.model, cell.rate, cell.producers, cell.policy,
                           cell.prefix_cache), []).append(cell)
    rows = []
    for (model, rate, producers, policy, _), group in sorted(groups.items()):
        ok = [c for c in group if c.status == "ok" and c.meets_slo]
        best = min(ok, key=lambda c: c.atoms) if ok else None
        rows.append({"model": model, "rate": rate, "request_rate": group[0].request_rate,
                     "producers": producers, "policy": policy,
                     "prefix_cache": group[0].prefix_cache,
                     "replicas": best.replicas if best else None,
                     "atoms": best.atoms if best else None,
                     "tried": sorted(c.replicas for c in group)})
    return rows


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _cache(cell: ClusterCell) -> str:
    return "on" if cell.prefix_cache else "off"


def format_table(report: ClusterReport) -> str:
    head = (f"{'model':<11} {'N':>3} {'M':>2} {'policy':<7} {'cache':>5} {'conv/s':>6} "
            f"{'req/s':>6} {'hit%':>5} {'TTFT p50':>8} {'TTFT p99':>8} {'TPOT p99':>8} {'tok/s':>7} "
            f"{'fail':>4} {'SLO':>3}  spread")
    lines = [head, "-" * len(head)]
    for c in report.cells:
        if c.status != "ok":
            lines.append(f"{c.model:<11} {c.replicas:>3} {c.producers:>2} {c.policy:<7} "
                         f"{_cache(c):>5} {c.rate:>6.2f}  {c.status}: {c.error}")
            continue
        lines.append(
            f"{c.model:<11} {c.replicas:>3} {c.producers:>2} {c.policy:<7} {_cache(c):>5} "
            f"{c.rate:>6.2f} {c.request_rate:>6.2f} {100 * c.prefix_hit_rate:>5.1f} "
            f"{_f(c.ttft.p50 if c.ttft else None):>8} {_f(c.ttft.p99 if c.ttft else None):>8} "
            f"{_f(c.tpot.p99 if c.tpot else None, 3):>8} {c.output_tok_s:>7.1f} {c.failed:>4} "
            f"{'yes' if c.meets_slo else 'no':>3}  {'/'.join(map(str, c.per_replica))}")
    lines.append(f"(virtual seconds on SimRuntime; SLO: TTFT p99 <= {report.slo_ttft_s} s, TPOT "
                 f"p99 <= {report.slo_tpot_s} s, nothing failed; costs: {report.costs})")
    if report.sizing:
        lines.append("")
        lines.append(f"{'model':<11} {'conv/s':>6} {'req/s':>6} {'M':>2} {'policy':<7} "
                     f"{'replicas':>8} {'ATOMs':>5}")
        for row in report.sizing:
            atoms = row["atoms"] if row["atoms"] is not None else f">{max(row['tried'])}"
            lines.append(f"{row['model']:<11} {row['rate']:>6.2f} {row['request_rate']:>6.2f} "
                         f"{row['producers']:>2} {row['policy']:<7} "
                         f"{row['replicas'] if row['replicas'] is not None else '-':>8} "
                         f"{atoms:>5}")
    return "\n".join(lines)


def _csv(kind: Any) -> Any:
    def parse(text: str) -> list[Any]:
        return [kind(part) for part in text.split(",") if part.strip()]
    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m atombatch.bench cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=_csv(str), default=["koni-8b"],
                   help=f"comma list of presets ({', '.join(MODELS)})")
    p.add_argument("--artifact", help=f"each replica's artifact (default {ARTIFACT}, koni-8b "
                   f"{ARTIFACTS['koni-8b']}; the syntax of bench serve: Bn/kn[/ctxN][/bsN][/tpN])")
    p.add_argument("--replicas", type=_csv(int), default=[2, 4])
    p.add_argument("--producers", type=_csv(int), default=[0],
                   help="PD producers (0: replicas prefill natively)")
    p.add_argument("--policies", type=_csv(str), default=list(POLICIES),
                   help="prefix, pow2 (Ray Serve's default), least-loaded, round-robin")
    p.add_argument("--rates", type=_csv(float), default=[1.0], help="conversations / s")
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--user-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--think-s", type=float, default=5.0)
    p.add_argument("--max-imbalance", type=int, default=4,
                   help="prefix policy: requests beyond the least loaded replica (default 4)")
    p.add_argument("--pd-mode", choices=("whole", "layer-stream"), default="layer-stream")
    p.add_argument("--prefix-cache", choices=("on", "off", "both"), default="on",
                   help="the replicas' prefix cache (both: every cell with and without it)")
    p.add_argument("--host-cache-gib", type=float,
                   help="each replica's host cache, GiB (default: none; 2 for hybrid models, "
                   "whose prefix cache keeps sliding-slot checkpoints there)")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT p99 bound, s (default 2)")
    p.add_argument("--slo-tpot", type=float, default=0.2,
                   help="time per output token p99 bound, s (default 0.2)")
    p.add_argument("--size", action="store_true",
                   help="also print the fewest ATOMs meeting the SLO per model, rate, policy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--no-progress", action="store_true",
                   help="no per-cell progress on stderr (default: a bar on a terminal, a line "
                   "per cell elsewhere)")
    p.add_argument("--ray", action="store_true",
                   help="instead: atombatch's router vs Ray Serve's default on a local Ray "
                   "(real HTTP; replicas on the simulator paced in wall time; needs the ray "
                   "extra)")
    p.add_argument("--concurrency", type=int, default=2, help="--ray: conversations at once")
    p.add_argument("--repeat", type=int, default=2, help="--ray: rounds (routers alternate)")
    p.add_argument("--ray-engine", help="--ray: every replica's engine flags, quoted (default: "
                   "the paced simulator, atombatch.bench.cluster_ray.ENGINE; 'numpy' for the "
                   "NumPy runtime's ENGINE_NUMPY)")
    p.add_argument("--ray-cpus", type=int, default=2, help="--ray: CPUs of the local Ray")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.ray:
        from atombatch.bench import cluster_ray

        engine = cluster_ray.ENGINE_NUMPY if args.ray_engine == "numpy" else \
            args.ray_engine.split() if args.ray_engine else cluster_ray.ENGINE
        results = cluster_ray.run(replicas=max(args.replicas), conversations=args.conversations,
                                  turns=args.turns, system_prompts=args.system_prompts,
                                  system_len=args.system_len, user_len=args.user_len,
                                  output_len=args.output_len, concurrency=args.concurrency,
                                  seed=args.seed, repeat=args.repeat, engine=list(engine),
                                  num_cpus=args.ray_cpus, max_imbalance=args.max_imbalance)
        print("python -m atombatch.bench cluster " + " ".join(argv or sys.argv[2:]))
        print(f"engine: {' '.join(engine)}")
        print(cluster_ray.format_table(results, list(engine)))
        if args.json:
            args.json.write_bytes(msgspec.json.format(msgspec.json.encode(results)))
        return 0
    try:
        for model in args.models:
            ModelSpec.preset(model)
        for name in args.policies:
            make_policy(name)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    costs = CostModel.default()
    cells = []
    caches = {"on": (True,), "off": (False,), "both": (False, True)}[args.prefix_cache]
    host = None if args.host_cache_gib is None else int(args.host_cache_gib * (1 << 30))
    total = len(args.models) * len(args.rates) * len(args.producers) * len(args.replicas) * \
        len(args.policies) * len(caches)
    progress = CellProgress(total, enabled=not args.no_progress)
    for model in args.models:
        for rate in args.rates:
            workload = Workload(rate=rate, conversations=args.conversations, turns=args.turns,
                                system_prompts=args.system_prompts, system_len=args.system_len,
                                user_len=args.user_len, output_len=args.output_len,
                                think_s=args.think_s, seed=args.seed)
            for producers in args.producers:
                for replicas in args.replicas:
                    for policy in args.policies:
                        for cache in caches:
                            what = (f"{model} rate {rate:g} N{replicas} M{producers} {policy}"
                                    f"{'' if cache else ' no-cache'}")
                            progress.start(what)
                            cell = run_cell(model, replicas, policy, workload,
                                            producers=producers, artifact_spec=args.artifact,
                                            costs=costs, slo_ttft=args.slo_ttft,
                                            slo_tpot=args.slo_tpot,
                                            max_imbalance=args.max_imbalance,
                                            pd_mode=args.pd_mode, prefix_cache=cache,
                                            host_cache_bytes=host)
                            progress.finish(what, cell.status if cell.status != "ok" else
                                            "meets the SLO" if cell.meets_slo else
                                            "misses the SLO")
                            cells.append(cell)
    progress.close()
    report = ClusterReport(
        command="python -m atombatch.bench cluster " + " ".join(argv or sys.argv[2:]),
        provenance={"commit": provenance.git_commit(), "machine": provenance.machine()},
        costs=costs.calibration.describe() if costs.calibration else "uncalibrated",
        slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
        workload=Workload(conversations=args.conversations, turns=args.turns,
                          system_prompts=args.system_prompts, system_len=args.system_len,
                          user_len=args.user_len, output_len=args.output_len,
                          think_s=args.think_s, seed=args.seed),
        cells=cells, sizing=size(cells) if args.size else [])
    print(format_table(report))
    if args.json:
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    return 0 if all(c.status != "error" for c in cells) else 1

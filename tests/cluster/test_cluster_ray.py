"""The Ray Serve application on a local Ray (`ray.init(num_cpus=2)`): NumPy replicas behind the
prefix-aware router, real HTTP from the `openai` client, a replica killed mid-stream, PD producers
in their own processes, one of them killed mid-request.

Expected tokens come from a plain `Batcher` on the same engine flags (`build_engine`): greedy
decoding is per lane, so neither routing nor batching can change them.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import openai
import pytest

ray = pytest.importorskip("ray", reason="the ray extra is part of the test extra")
from ray import serve  # noqa: E402

from atombatch.api.structs import SamplingParams  # noqa: E402
from atombatch.cluster import route_digests  # noqa: E402
from atombatch.errors import ConfigError  # noqa: E402
from atombatch.serve.cli import build_engine, parser  # noqa: E402
from atombatch.serve.ray import board, build_app  # noqa: E402

pytestmark = pytest.mark.ray

ENGINE = ["--batch-size", "2", "--max-seq-len", "1024", "--block-size", "64", "--num-blocks", "40",
          "--prefill-chunk-size", "64", "--prefix-cache", "--seed", "3"]
SYSTEM = [(7 * i) % 1000 + 3 for i in range(192)]   # a shared 192-token "system prompt"


def expected(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    batcher, _, _ = build_engine(parser().parse_args(ENGINE))
    done = batcher.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return [list(c.token_ids) for c in done]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def app_names() -> Iterator[list[str]]:
    """Applications a test deployed; deleted after it (the 2 CPUs are shared by the tests)."""
    names: list[str] = []
    yield names
    for name in names:
        serve.delete(name)


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    # Ray's memory monitor kills workers when the *machine* is short of memory (other processes
    # count too); these replicas are small, so it is turned off for the test cluster.
    os.environ["RAY_memory_monitor_refresh_ms"] = "0"  # noqa: SIM112 (Ray spells it so)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def reports(app: str) -> dict[str, dict[str, Any]]:
    return {k: v["stats"] for k, v in ray.get(board(app).reports.remote()).items()}


def wait_reports(app: str, count: int, timeout: float = 30.0) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = reports(app)
        if len(found) >= count:
            return found
        time.sleep(0.2)
    raise AssertionError(f"{count} replicas did not report within {timeout} s: {found}")


def stream_ids(response: Any) -> tuple[list[int], str | None]:
    ids: list[int] = []
    reason = None
    for chunk in response:
        if chunk.choices:
            ids.extend(getattr(chunk.choices[0], "token_ids", None) or [])
            reason = chunk.choices[0].finish_reason or reason
    return ids, reason


def test_two_replicas_stream_with_prefix_affinity_and_merged_metrics(cluster: str,
                                                                     app_names: list[str]) -> None:
    app_names.append("affinity")
    serve.run(build_app(ENGINE, replicas=2, replica_cpus=0.25, routing_stats_s=0.2),
              name="affinity", route_prefix="/affinity")
    base = f"{cluster}/affinity"
    wait_reports("affinity", 2)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
    groups = {g: [SYSTEM[: 64 * (g + 1)] + [g + 3] * 64 + [t + 10] * 8 for t in range(3)]
              for g in range(2)}
    prompts = [p for g in groups.values() for p in g]
    want = expected(prompts, 6)
    got, replicas = [], {}
    for index, prompt in enumerate(prompts):      # one at a time: the router sees idle replicas
        with httpx.Client(timeout=120) as http:
            answer = http.post(f"{base}/v1/completions",
                               json={"prompt": prompt, "max_tokens": 6, "temperature": 0})
        assert answer.status_code == 200, answer.text
        replicas[index] = answer.headers["x-atombatch-replica"]
        got.append(answer.json()["choices"][0]["token_ids"])
    assert got == want
    # every request of a group went where its first one went; the groups' later requests hit
    assert len({replicas[0], replicas[1], replicas[2]}) == 1
    assert len({replicas[3], replicas[4], replicas[5]}) == 1
    # affinity beats load: while a long stream of group 0 runs on its replica, another request
    # of group 0 still goes there (a lane is free) rather than to the idle replica
    with httpx.Client(timeout=120) as http:
        body = {"prompt": groups[0][0], "max_tokens": 800, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with http.stream("POST", f"{base}/v1/completions", json=body) as running:
            lines = running.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            busy = running.headers["x-atombatch-replica"]
            # the router hears of the load within a few stats periods; on a loaded machine a
            # report can lag (the one decision then rests on stale figures), so it gets three
            # chances a second apart: it must choose the busy replica at least once
            chosen = []
            for _ in range(3):
                time.sleep(0.6 if not chosen else 1.0)
                again = http.post(f"{base}/v1/completions", json={
                    "prompt": groups[0][2], "max_tokens": 2, "temperature": 0})
                chosen.append(again.headers["x-atombatch-replica"])
                if chosen[-1] == busy:
                    break
            assert busy == replicas[0] and busy in chosen, (busy, chosen)
            assert [line for line in lines if line][-1] == "data: [DONE]"
    time.sleep(1.0)
    stats = wait_reports("affinity", 2)
    assert sum(s["prefix_hits"] for s in stats.values()) >= 4
    for replica in {replicas[0], replicas[3]}:
        assert stats[replica]["prefix_hits"] >= 2

    # streaming through the openai client, several at once, on both replicas
    stream = client.completions.create(model="atombatch-tiny", prompt=prompts[0], max_tokens=6,
                                       temperature=0, stream=True)
    assert stream_ids(stream) == (want[0], "length")
    chat = client.chat.completions.create(model="atombatch-tiny", temperature=0, max_tokens=4,
                                          messages=[{"role": "user", "content": "<5><6><7>"}],
                                          stream=True)
    # token-id text: one "<id>" per token (an event may carry several tokens when the front
    # reads a step late: the engine core streams what it has)
    text = "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
    assert text.count("<") == 4 and text.startswith("<") and text.endswith(">"), text
    client.close()

    metrics = httpx.get(f"{base}/metrics", timeout=30).text
    for replica in stats:
        assert f'atombatch_lanes{{replica="{replica}"}} 2.0' in metrics
    assert httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"] == "atombatch-tiny"
    bad = httpx.post(f"{base}/v1/completions", json={"prompt": [1], "max_tokens": 0},
                     timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"

    # The router reads the replicas' caches: once group 0's replica evicted it, group 0 no
    # longer attracts requests there. Fresh prompts that the router's tie-break sends to that
    # replica fill its 40 blocks (LRU: group 0's blocks go first).
    holder = replicas[0]
    (other,) = [r for r in stats if r != holder]
    http = httpx.Client(timeout=120)
    flooded = 0
    for g in range(60):
        flood = [500 + g] * 384
        first = route_digests(flood)[0]
        if min((holder, other), key=lambda r: hashlib.blake2b(
                first + r.encode(), digest_size=8).digest()) != holder:
            continue
        time.sleep(0.3)                           # both idle in the router's eyes
        answer = http.post(f"{base}/v1/completions",
                           json={"prompt": flood, "max_tokens": 1, "temperature": 0})
        flooded += answer.headers["x-atombatch-replica"] == holder
        if flooded == 7:                          # 7 x 6 blocks > 40
            break
    assert flooded == 7
    time.sleep(2.5)                               # past pending_s: only the reports count
    body = {"prompt": flood, "max_tokens": 600, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with http.stream("POST", f"{base}/v1/completions", json=body) as running:
        lines = running.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        assert running.headers["x-atombatch-replica"] == holder   # its cache holds the flood
        time.sleep(0.6)                           # the router hears of the load
        again = http.post(f"{base}/v1/completions",
                          json={"prompt": groups[0][2], "max_tokens": 2, "temperature": 0})
        # the holder is busier and no longer holds group 0: the idle replica takes it (a router
        # that only remembered where it sent group 0 would send it to the holder, lane free)
        assert again.headers["x-atombatch-replica"] == other
        assert again.json()["choices"][0]["token_ids"] == want[2][:2]
        assert [line for line in lines if line][-1] == "data: [DONE]"
    http.close()


def test_replica_killed_mid_stream(cluster: str, app_names: list[str]) -> None:
    app_names.append("kill")
    serve.run(build_app(ENGINE, replicas=2, replica_cpus=0.25, routing_stats_s=0.2),
              name="kill", route_prefix="/kill")
    base = f"{cluster}/kill"
    wait_reports("kill", 2)
    http = httpx.Client(timeout=120)
    long = {"max_tokens": 900, "temperature": 0, "stream": True, "ignore_eos": True}
    streams = []
    for g in range(4):                            # spread over both replicas (distinct prefixes)
        prompt = [g + 3] * 64 + [5, 6, 7]
        response = http.send(http.build_request("POST", f"{base}/v1/completions",
                                                json={"prompt": prompt, **long}), stream=True)
        assert response.status_code == 200
        streams.append((response, response.headers["x-atombatch-replica"], response.iter_lines()))
    victim = streams[0][1]
    assert {s[1] for s in streams} != {victim}, "the router put every stream on one replica"
    next(line for line in streams[0][2] if line.startswith("data: {"))   # it is streaming
    core_pid = reports("kill")[victim]["engine_core"]    # the victim's engine core process
    os.kill(core_pid, 0)
    actor = ray.get_actor(f"SERVE_REPLICA::kill#AtomReplica#{victim}", namespace="serve")
    ray.kill(actor, no_restart=True)
    for response, replica, lines in streams:
        events = [line for line in lines if line.startswith("data: ")]
        response.close()
        if replica == victim:
            assert '"replica_failed"' in events[-1]               # ended with an error event
            assert events[-1] != "data: [DONE]"
        else:
            assert events[-1] == "data: [DONE]"
            tokens = sum(len(e.split('"token_ids":[')[1].split("]")[0].split(","))
                         for e in events if '"token_ids":[' in e and '"token_ids":[]' not in e)
            assert tokens == 900                                  # the others ran to the end
    # the replica's engine core saw its front die and ended (aborting what it held)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{core_pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break                                 # exited, not yet reaped
        except OSError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the dead replica's engine core {core_pid} outlived it by 20 s")
    # the router stops using the dead replica: later requests all land elsewhere and succeed
    for g in range(4):
        answer = http.post(f"{base}/v1/completions", json={"prompt": [g + 3] * 64 + [5, 6, 7],
                                                            "max_tokens": 3, "temperature": 0})
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-atombatch-replica"] != victim

    # a replica whose engine core dies answers 503 and fails its health check; Serve replaces
    # it, and requests succeed again on a fresh replica (and core)
    (other,) = {answer.headers["x-atombatch-replica"]}
    other_core = reports("kill")[other]["engine_core"]
    os.kill(other_core, signal.SIGKILL)
    deadline = time.monotonic() + 90
    statuses = set()
    while time.monotonic() < deadline:
        answer = http.post(f"{base}/v1/completions", json={"prompt": [3] * 64 + [5, 6, 7],
                                                            "max_tokens": 3, "temperature": 0})
        statuses.add(answer.status_code)
        if answer.status_code == 200 and answer.headers["x-atombatch-replica"] not in \
                (victim, other):
            break
        # 500: the request the core's exit failed; 503: the front, its core gone (until the
        # health check replaces the replica, within seconds)
        assert answer.status_code in (200, 500, 503), answer.text
        time.sleep(0.5)
    else:
        pytest.fail(f"no replacement replica served within 90 s (statuses {statuses})")
    http.close()


def producer(name: str) -> Any:
    return ray.get_actor(name, namespace="atombatch")


def pool_of(app: str) -> dict[str, dict[str, Any]]:
    (stats,) = reports(app).values()
    return {p["name"]: p for p in stats["producers"]}


def wait_for(what: str, check: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout} s")


def holding(names: list[str]) -> list[str]:
    """The producers holding a request at their gate (paused after its header)."""
    return [n for n in names if ray.get(producer(n).status.remote())["held"]]


def test_pd_producers_in_their_own_processes(cluster: str, app_names: list[str]) -> None:
    from atombatch.serve.ray import remove_producers, scale_producers

    app_names.append("pd")
    names = ["pd-producer-0", "pd-producer-1"]
    serve.run(build_app(ENGINE, replicas=1, replica_cpus=0.25, producers=2, routing_stats_s=0.2,
                        app_name="pd", pd_check_s=0.2, report_s=0.2),
              name="pd", route_prefix="/pd")
    base = f"{cluster}/pd"
    try:
        wait_for("both producers in the pool", lambda: sorted(pool_of("pd")) == names)
        http = httpx.Client(timeout=120)
        prompts = [[g + 3] * 40 + [9, 8] for g in range(2)]
        want = expected(prompts, 5)

        def ask(prompt: list[int]) -> list[int]:
            answer = http.post(f"{base}/v1/completions",
                               json={"prompt": prompt, "max_tokens": 5, "temperature": 0})
            assert answer.status_code == 200, answer.text
            return list(answer.json()["choices"][0]["token_ids"])

        assert [ask(p) for p in prompts] == want                                # PD == native
        wait_for("the opens reported", lambda: sorted(
            p["opened"] for p in pool_of("pd").values()) == [1, 1])           # by load: one each
        (stats,) = reports("pd").values()
        assert stats["imports"] > 0 and stats["prefill_chunks"] == 0
        # the engine, and the pool whose snapshot this is, run in the replica's core process
        assert isinstance(stats["engine_core"], int) and stats["engine_core"] != stats["pid"]
        assert stats["native_fallbacks"] == 0
        metrics = httpx.get(f"{base}/metrics", timeout=30).text   # the pool on /metrics
        assert f'atombatch_pd_producers{{replica="{stats["replica"]}",state="live"}} 2.0' in \
            metrics, metrics

        # a producer killed while a request's layers are due: both producers hold every request
        # after its header, the one holding it is killed, so no layer of it was ever sent; a
        # prompt never served before, so the prefix cache cannot stand in for the import
        for name in names:
            ray.get(producer(name).pause.remote())
        fresh = [11] * 40 + [9, 8]
        doomed = http.send(http.build_request("POST", f"{base}/v1/completions",
                                              json={"prompt": fresh, "max_tokens": 5,
                                                    "temperature": 0, "stream": True}),
                           stream=True)
        (busy,) = wait_for("a producer holding the request", lambda: holding(names))
        (survivor,) = [n for n in names if n != busy]
        victim = producer(busy)
        ray.kill(victim, no_restart=True)
        # `ray.kill` returns before the actor is dead (the GCS forwards it): until it lands the
        # actor still runs (and, not held, would go on sending layers)
        killed = time.monotonic()

        def dead() -> bool:
            try:
                ray.get(victim.ping.remote(), timeout=5)
            except ray.exceptions.RayActorError:
                return True
            return False

        wait_for("the killed producer dead", dead, timeout=60)
        print(f"ray.kill landed within {time.monotonic() - killed:.2f} s")
        ray.get(producer(survivor).resume.remote())
        events = [line for line in doomed.iter_lines() if line.startswith("data: ")]
        doomed.close()
        errors = [e for e in events if '"error"' in e]
        assert len(errors) == 1 and "KV producer" in errors[0], events
        assert not any('"token_ids":[' in e for e in events)
        # the survivor takes every later request; the dead one leaves the pool and the registry
        assert [ask(p) for p in prompts] == want
        wait_for("the dead producer out of the pool", lambda: list(pool_of("pd")) == [survivor])
        assert sorted(ray.get(board("pd").producers.remote())) == [survivor]

        # scaling up while the application runs: the new producer is used at once
        assert scale_producers("pd", 2) == sorted(names)   # with the flags the app was built with
        wait_for("the new producer in the pool", lambda: sorted(pool_of("pd")) == names)
        before = ray.get(producer(busy).status.remote())["served"]
        assert ask(fresh) == expected([fresh], 5)[0]   # least loaded, least recently used: new
        assert ray.get(producer(busy).status.remote())["served"] == before + 1

        # removing a producer while it holds a request: it is no longer chosen, its request
        # finishes (exactly), then it ends
        for name in names:
            ray.get(producer(name).pause.remote())
        other = [14] * 40 + [9, 8]
        pending = http.send(http.build_request("POST", f"{base}/v1/completions",
                                               json={"prompt": other, "max_tokens": 5,
                                                     "temperature": 0, "stream": True}),
                            stream=True)
        (leaving,) = wait_for("a producer holding the request", lambda: holding(names))
        (staying,) = [n for n in names if n != leaving]
        remover = threading.Thread(target=remove_producers, args=("pd", [leaving]),
                                   kwargs={"settle_s": 0.5})
        remover.start()
        wait_for("the leaving producer retired", lambda: pool_of("pd").get(
            leaving, {}).get("retired"))
        ray.get(producer(staying).resume.remote())
        served = ray.get(producer(staying).status.remote())["served"]
        third = [15] * 40 + [9, 8]
        assert ask(third) == expected([third], 5)[0]   # not sent to the retiring producer
        assert ray.get(producer(staying).status.remote())["served"] == served + 1
        ray.get(producer(leaving).resume.remote())
        events = [line for line in pending.iter_lines() if line.startswith("data: ")]
        pending.close()
        ids = [t for e in events if e != "data: [DONE]"
               for t in msgspec.json.decode(e[6:])["choices"][0]["token_ids"]]
        assert ids == expected([other], 5)[0] and events[-1] == "data: [DONE]"
        remover.join(timeout=60)
        assert not remover.is_alive()
        wait_for("the removed producer out of the pool", lambda: list(pool_of("pd")) == [staying])
        assert sorted(ray.get(board("pd").producers.remote())) == [staying]
        with pytest.raises(ValueError):
            producer(leaving)                          # ended
        http.close()
        with pytest.raises(ConfigError, match="count=-1"):
            scale_producers("pd", -1)
        with pytest.raises(ConfigError, match="no stored producer engine flags"):
            scale_producers("affinity", 1)             # not a PD application
        # issue 17: a producer the cluster cannot place hung the call for good, and a retry then
        # failed with ActorAlreadyExistsError; now it fails naming what it asked for, and a
        # name a pending attempt left behind is replaced
        assert scale_producers("pd", 2, replica_cpus=64, wait=False) == [staying]
        for _ in range(2):
            with pytest.raises(ConfigError, match="did not come up within placement_timeout"):
                scale_producers("pd", 2, replica_cpus=64, placement_timeout=2.0)
        assert sorted(ray.get(board("pd").producers.remote())) == [staying]
    finally:
        scale_producers("pd", 0, drain_s=0.0, settle_s=0.0)


def test_pd_with_the_engine_inline_in_the_replica(cluster: str, app_names: list[str]) -> None:
    """`--engine-core inline`: the engine and the pool in the replica's own process."""
    from atombatch.serve.ray import scale_producers

    app_names.append("inline")
    serve.run(build_app([*ENGINE, "--engine-core", "inline"], replicas=1, replica_cpus=0.25,
                        producers=1, app_name="inline", pd_check_s=0.2, report_s=0.2),
              name="inline", route_prefix="/inline")
    try:
        wait_for("the producer in the pool", lambda: list(pool_of("inline")) ==
                 ["inline-producer-0"])
        prompt = [21] * 40 + [9, 8]
        answer = httpx.post(f"{cluster}/inline/v1/completions", timeout=120,
                            json={"prompt": prompt, "max_tokens": 5, "temperature": 0})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["token_ids"] == expected([prompt], 5)[0]
        # reports lag the request (one every 0.2 s): the one after it ended
        (stats,) = wait_for("the request's end reported", lambda: [
            s for s in reports("inline").values() if s["finished"].get("length")])
        assert pool_of("inline")["inline-producer-0"]["opened"] == 1
        assert "engine_core" not in stats and stats["imports"] > 0
        assert stats["prefill_chunks"] == 0
    finally:
        scale_producers("inline", 0, drain_s=0.0, settle_s=0.0)


@pytest.mark.slow
def test_sigterm_stops_the_local_cluster_it_started(tmp_path: Any) -> None:
    """Issue 17: after SIGTERM of `python -m atombatch.serve.ray`, Ray's DashboardAgent and
    RuntimeEnvAgent stayed alive (PPID 1). Every process the command started must end with it."""
    import os
    import signal
    import subprocess
    import sys

    from support.served import free_port

    def descendants(pid: int) -> set[int]:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as stat:
                        fields = stat.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                children.setdefault(int(fields[1]), []).append(int(entry))
        found, todo = set(), [pid]
        while todo:
            for child in children.get(todo.pop(), []):
                if child not in found:
                    found.add(child)
                    todo.append(child)
        return found

    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "atombatch.serve.ray", "--num-cpus", "1", "--replicas", "1",
         "--replica-cpus", "0.5", "--port", str(port), "--max-seq-len", "64",
         "--log-level", "error"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            time.sleep(0.5)
        started = descendants(process.pid)
        assert started, "the command started no Ray processes"
        process.send_signal(signal.SIGTERM)
        process.wait(120)

        def alive() -> set[int]:
            running = set()
            for pid in started:
                try:
                    with open(f"/proc/{pid}/stat") as stat:
                        state = stat.read().rsplit(")", 1)[1].split()[0]
                except OSError:
                    continue
                if state != "Z":
                    running.add(pid)
            return running
        wait_for("every Ray process of the command gone", lambda: not alive(), timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        if process.stderr is not None:
            process.stderr.close()


def test_ray_cli_runs_the_servers_lora_checks(capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m atombatch.serve.ray` refuses the LoRA flags the plain server refuses, with the
    same words, before it starts Ray (issue 41)."""
    from atombatch.serve.ray.cli import main

    for argv, words in ((["--runtime", "sim", "--enable-lora"], "the sim runtime loads no"),
                        (["--lora-modules", "a=/nowhere"], "LoRA is off; add --enable-lora"),
                        (["--enable-lora", "--max-loras", "0"], "--max-loras 0 must be >= 1"),
                        (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"],
                         "--max-cpu-loras 2 must be >= --max-loras 4")):
        assert main(["--replicas", "1", *argv]) == 2, argv
        assert words in capsys.readouterr().err, argv


def test_a_replica_serves_lora_modules_as_the_plain_server(cluster: str, app_names: list[str],
                                                          tmp_path: Any) -> None:
    """A replica passes the LoRA options to its app as `atombatch.serve` does (one function,
    `lora.app_options`): `--lora-modules` are listed by /v1/models under the base with their
    directory, `--max-loras` is on /metrics, a request naming an adapter runs it (tokens as
    transformers + PEFT), the base still answers as before."""
    from support import hf_models as hf
    from support import lora_models as lm

    hf.save_checkpoint("llama", tmp_path / "ckpt", seed=0)
    lm.save_adapter("llama", lm.CASES["attn-r4"], tmp_path / "a", base_seed=0)
    prompt = [1, 17, 42, 99, 7]
    base_want = hf.hf_greedy(hf.load_float32(tmp_path / "ckpt"), prompt, 6)
    lora_want = hf.hf_greedy(lm.peft_model("llama", lm.CASES["attn-r4"], base_seed=0), prompt, 6)
    assert lora_want != base_want  # the adapter moves the tokens
    app_names.append("lora")
    engine = ["--model", str(tmp_path / "ckpt"), "--max-model-len", "256", "--batch-size", "2",
              "--served-model-name", "tiny-llama", "--enable-lora", "--max-loras", "1",
              "--lora-modules", f"a={tmp_path / 'a'}"]
    serve.run(build_app(engine, replicas=1, replica_cpus=0.25), name="lora",
              route_prefix="/lora")
    base = f"{cluster}/lora"
    with httpx.Client(timeout=120) as http:
        models = http.get(f"{base}/v1/models").json()["data"]
        assert {(m["id"], m.get("parent")) for m in models} >= {("tiny-llama", None),
                                                                 ("a", "tiny-llama")}
        # the directory it was served from (`lora_paths`; the engine core only knows the name)
        assert next(m["root"] for m in models if m["id"] == "a") == str(tmp_path / "a")
        # --max-loras reaches the app: vllm:lora_requests_info's max_lora label, as vLLM's
        assert 'max_lora="1"' in http.get(f"{base}/metrics").text
        for model, want in (("a", lora_want), ("tiny-llama", base_want)):
            answer = http.post(f"{base}/v1/completions",
                               json={"model": model, "prompt": prompt, "max_tokens": 6,
                                     "temperature": 0, "ignore_eos": True})
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["token_ids"] == want, model

"""LoRA adapters served as vLLM serves them (issue 41, item 4; docs/lora.md#serving-adapters).

A tiny random Llama checkpoint and PEFT adapters made by peft (tests/support/lora_models.py) are
served by `python -m atombatch.serve --enable-lora --lora-modules ...` in every engine-core mode
(`--engine-core inline`, `process`, `--api-server-count 2`), and the official openai SDK asks
for them by `model`: each answer is transformers + peft's greedy continuation of that adapter
(the base model's for the served name), with base and adapter requests interleaved at once.
Then `/v1/models` (adapters with `parent` and `root`), the load and unload endpoints behind
`VLLM_ALLOW_RUNTIME_LORA_UPDATING` (load -> use -> unload -> 404; off -> the router's 404; a bad
path, hostile bodies -> 400), `vllm:lora_requests_info`, and the startup errors.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fakerebel.compiler import compile_dir, lora_adapter, lora_config
from support import hf_models as hf
from support import lora_models as lm
from support.paced import PacedDecode
from support.served import ServerThread, served

from atombatch import ArtifactConfig, Batcher, ConfigError, ModelSpec
from atombatch.core.messages import LoadLora, LoraDone, UnloadLora
from atombatch.core.process import CoreLoop, To
from atombatch.runtime import NumpyRuntime, RebelRuntime
from atombatch.serve import create_app
from atombatch.serve.cli import build_engine, main, parser

MODES = {"inline": ("--engine-core", "inline"), "process": ("--engine-core", "process"),
         "fronts": ("--api-server-count", "2")}
BASE = "tiny-llama"
PROMPTS = [[1, 17, 42, 99, 7], [1, 300, 5, 5, 260, 11, 48, 3], [1, 64, 128, 256, 500, 2, 9]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The checkpoint and three adapter directories (a, b served from the start; c loaded)."""
    root = tmp_path_factory.mktemp("lora-serve")
    hf.save_checkpoint("llama", root / "ckpt", seed=0)
    found = {"ckpt": root / "ckpt"}
    for name, case in (("a", "attn-r4"), ("b", "mlp-r8-rslora"), ("c", "all-linear-r2")):
        lm.save_adapter("llama", lm.CASES[case], root / name, base_seed=0)
        found[name] = root / name
    return found


@pytest.fixture(scope="module")
def references(files: dict[str, Path]) -> dict[str, list[list[int]]]:
    """transformers (+ peft) greedy tokens of every prompt: the base model and each adapter."""
    out = {BASE: [hf.hf_greedy(hf.load_float32(files["ckpt"]), p, MAX_TOKENS) for p in PROMPTS]}
    for name, case in (("a", "attn-r4"), ("b", "mlp-r8-rslora"), ("c", "all-linear-r2")):
        model = lm.peft_model("llama", lm.CASES[case], base_seed=0)
        out[name] = [hf.hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    for name in ("a", "b", "c"):  # the adapters really move the tokens (else nothing is shown)
        assert out[name] != out[BASE], name
    return out


def flags(files: dict[str, Path], *more: str) -> list[str]:
    spelled_as_json = json.dumps({"name": "b", "path": str(files["b"]),
                                  "base_model_name": BASE})
    return ["--model", str(files["ckpt"]), "--max-model-len", "512", "--batch-size", "4",
            "--served-model-name", BASE, "--enable-lora", "--lora-modules",
            f"a={files['a']}", spelled_as_json, *more]


@contextlib.contextmanager
def updates_allowed(value: str = "1") -> Iterator[None]:
    saved = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]
        else:
            os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = saved


@pytest.fixture(scope="module")
def urls(files: dict[str, Path]) -> Iterator[dict[str, str]]:
    """One server per engine-core mode, runtime updates allowed (vLLM's spelling "True")."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(updates_allowed(" True "))
        found = {}
        for mode, extra in MODES.items():
            url, _ = stack.enter_context(served(*flags(files, *extra)))
            found[mode] = url
        yield found


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def complete(url: str, model: str, prompt: list[int]) -> tuple[str, list[int]]:
    """(the response's model, its tokens) of one greedy completion through the openai SDK."""
    with sdk(url) as client:
        answer = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                           temperature=0.0, extra_body={"ignore_eos": True})
    return answer.model, list(answer.choices[0].model_extra["token_ids"])


@pytest.mark.parametrize("mode", MODES)
def test_an_adapter_named_by_model_answers_as_transformers_with_peft(
        urls: dict[str, str], references: dict[str, list[list[int]]], mode: str) -> None:
    """Base and both adapters, every prompt, all at once: each answer is its own reference
    (an adapter applied to the wrong rows, or a prefix shared across adapters, would not be)."""
    jobs = [(model, i) for _ in range(2) for model in (BASE, "a", "b")
            for i in range(len(PROMPTS))]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda job: complete(urls[mode], job[0], PROMPTS[job[1]]), jobs))
    for (model, i), (said, tokens) in zip(jobs, answers, strict=True):
        assert said == model
        assert tokens == references[model][i], (mode, model, i)


@pytest.mark.parametrize("mode", MODES)
def test_chat_and_responses_run_the_adapter_too(urls: dict[str, str], mode: str) -> None:
    """The chat and Responses routes route `model` as completions does: the same prompt ids
    (rendered by /tokenize under the adapter's name) give the same tokens."""
    url = urls[mode]
    messages = [{"role": "user", "content": "<1><17><42><99><7>"}]
    rendered = httpx.post(f"{url}/tokenize", json={"model": "a", "messages": messages}).json()
    _, expected = complete(url, "a", rendered["tokens"])
    _, base = complete(url, BASE, rendered["tokens"])
    assert expected != base
    with sdk(url) as client:
        chat = client.chat.completions.create(model="a", messages=messages,  # type: ignore[arg-type]
                                              max_tokens=MAX_TOKENS, temperature=0.0,
                                              extra_body={"ignore_eos": True})
        assert chat.model == "a"
        assert chat.choices[0].model_extra["token_ids"] == expected
        response = client.responses.create(model="a", input="<1><17><42><99><7>",
                                           max_output_tokens=MAX_TOKENS, temperature=0.0,
                                           extra_body={"ignore_eos": True})
        assert response.model == "a"


@pytest.mark.parametrize("mode", MODES)
def test_models_lists_the_adapters_with_their_parent(urls: dict[str, str], files: dict[str, Path],
                                                     mode: str) -> None:
    with sdk(urls[mode]) as client:
        cards = {card.id: card for card in client.models.list()}
        assert list(cards) == [BASE, "a", "b"]
        assert cards[BASE].model_extra["parent"] is None
        for name in ("a", "b"):
            extra = cards[name].model_extra
            assert extra["parent"] == BASE
            assert extra["root"] == str(files[name])
        card = client.models.retrieve("b").model_extra
        assert card["parent"] == BASE
        if mode == "inline":  # the engine's record of it is in this process
            assert card["atombatch"]["r"] == 8 and card["atombatch"]["lora_int_id"] == 2
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("nope")
        with pytest.raises(openai.NotFoundError) as caught:
            client.completions.create(model="nope", prompt=[1, 2], max_tokens=2)
        assert "'a', 'b'" in str(caught.value)  # the 404 names the served adapters


@pytest.mark.parametrize("mode", MODES)
def test_load_use_unload_then_404(urls: dict[str, str], files: dict[str, Path],
                                  references: dict[str, list[list[int]]], mode: str) -> None:
    url = urls[mode]
    with sdk(url) as client:  # the openai SDK's plain POST, as vLLM's docs use it
        said = client.post("/load_lora_adapter", cast_to=str,
                           body={"lora_name": "c", "lora_path": str(files["c"])})
    assert said == "Success: LoRA adapter 'c' added successfully."
    try:
        again = httpx.post(f"{url}/v1/load_lora_adapter",
                           json={"lora_name": "c", "lora_path": str(files["c"])})
        assert again.status_code == 400 and "already been loaded" in again.text
        # several requests: with two fronts, both learn the adapter (the core tells each)
        for i in (0, 1, 2, 0, 1, 2):
            assert complete(url, "c", PROMPTS[i]) == ("c", references["c"][i])
        with sdk(url) as client:
            assert [card.id for card in client.models.list()] == [BASE, "a", "b", "c"]
    finally:
        unload = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "c"})
    assert unload.status_code == 200, unload.text
    assert unload.text == "Success: LoRA adapter 'c' removed successfully."
    for _ in range(4):
        with sdk(url) as client, pytest.raises(openai.NotFoundError):
            client.completions.create(model="c", prompt=PROMPTS[0], max_tokens=2)
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "c"})
    assert gone.status_code == 404 and "cannot be found" in gone.text


def test_bad_paths_and_hostile_bodies_are_400(urls: dict[str, str], files: dict[str, Path],
                                             tmp_path: Path) -> None:
    url = urls["process"]
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    # review: a FIFO (no writer) or /dev/zero where the files should be hung the core's loader
    # thread (and every later load) or read without end; now refused at once
    for kind in ("fifo", "zero"):
        hostile = tmp_path / kind
        shutil.copytree(files["c"], hostile)
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            (hostile / name).unlink()
            if kind == "fifo":
                os.mkfifo(hostile / name)
            else:
                (hostile / name).symlink_to("/dev/zero")
    for path in (tmp_path / "missing", tmp_path / "empty", tmp_path / "file", tmp_path / "fifo",
                 tmp_path / "zero"):
        r = httpx.post(f"{url}/v1/load_lora_adapter", timeout=60,
                       json={"lora_name": "bad", "lora_path": str(path)})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "lora_path" and str(path) in error["message"]
    both: list[Any] = [  # bad for either route
        b"{not json", b"[]", b'"x"', json.dumps({"lora_name": 5, "lora_path": "p"}).encode(),
        json.dumps({"lora_name": "", "lora_path": "p"}).encode(), b"{}",
        json.dumps({"lora_name": "x" * 1000, "lora_path": "p"}).encode(),
        json.dumps({"lora_name": "x", "lora_path": "p", "pad": "y" * 20_000}).encode(),
        json.dumps({"lora_name": "x", "lora_int_id": "one"}).encode(),
        b"[" * 5000 + b"]" * 5000]
    load_only: list[Any] = [
        json.dumps({"lora_name": "x", "lora_path": ["p"]}).encode(),
        json.dumps({"lora_name": "x"}).encode(),
        json.dumps({"lora_name": "x", "lora_path": "p" * 15_000}).encode(),
        json.dumps({"lora_name": "x", "lora_path": "a\u0000b"}).encode(),
        json.dumps({"lora_name": "x", "lora_path": "p", "load_inplace": "yes"}).encode()]
    for route, bodies in (("load_lora_adapter", both + load_only),
                          ("unload_lora_adapter", both)):
        for body in bodies:
            r = httpx.post(f"{url}/v1/{route}", content=body,
                           headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (route, body[:60], r.status_code, r.text)
            assert r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": BASE, "lora_path": "p"})
    assert r.status_code == 400 and "conflicts with a served base model" in r.text
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "p",
                                                          "load_inplace": True})
    assert r.status_code == 400 and "load_inplace is not supported" in r.text
    with sdk(url) as client:  # nothing was loaded, the server serves on
        assert [card.id for card in client.models.list()] == [BASE, "a", "b"]
        assert complete(url, "a", PROMPTS[0])[0] == "a"


def test_without_the_environment_flag_the_routes_are_404(files: dict[str, Path]) -> None:
    with updates_allowed("0"), served(*flags(files, "--engine-core", "inline")) as (url, _):
        for route in ("load_lora_adapter", "unload_lora_adapter"):
            r = httpx.post(f"{url}/v1/{route}",
                           json={"lora_name": "c", "lora_path": str(files["c"])})
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
        assert complete(url, "a", PROMPTS[0])[0] == "a"  # the static adapters still serve


def test_lora_requests_info_as_vllm_shapes_it(urls: dict[str, str]) -> None:
    """vLLM's gauge: labels max_lora, waiting and running adapters (no model or engine label),
    its value a time; running names the adapter of a request in flight."""
    url = urls["process"]
    seen: set[str] = set()
    with sdk(url) as client:
        stream = client.completions.create(model="b", prompt=PROMPTS[1], max_tokens=480,
                                           temperature=0.0, stream=True,
                                           extra_body={"ignore_eos": True})
        for _ in stream:
            for line in httpx.get(f"{url}/metrics").text.splitlines():
                if line.startswith("vllm:lora_requests_info{"):
                    seen.add(line.split("}")[0] + "}")
            if 'running_lora_adapters="b"' in "".join(seen):
                stream.close()
                break
    assert any('max_lora="1"' in s and 'running_lora_adapters="b"' in s for s in seen), seen
    assert all("model_name" not in s for s in seen)


def test_startup_errors_name_the_flag_and_the_path(files: dict[str, Path], tmp_path: Path,
                                                   capsys: Any) -> None:
    base = ["--model", str(files["ckpt"]), "--max-model-len", "128", "--engine-core", "inline",
            "--port", "0"]
    assert main([*base, "--lora-modules", f"a={files['a']}"]) == 2
    assert "--enable-lora" in capsys.readouterr().err
    assert main([*base, "--enable-lora", "--lora-modules", f"a={tmp_path / 'nowhere'}"]) == 2
    assert str(tmp_path / "nowhere") in capsys.readouterr().err
    assert main([*base, "--enable-lora", "--max-lora-rank", "1", "--lora-modules",
                 f"a={files['a']}"]) == 2
    assert "rank" in capsys.readouterr().err
    assert main(["--runtime", "sim", "--port", "0", "--enable-lora"]) == 2
    assert "loads no adapters" in capsys.readouterr().err
    assert main([*base, "--enable-lora", "--lora-modules", f"a={files['a']}",
                 f"a={files['b']}"]) == 2
    assert "twice" in capsys.readouterr().err
    # review: without --served-model-name the served name is the directory's ("ckpt"): an
    # adapter of that name was loaded, listed, and never run (requests naming it got the base)
    # (build_engine, not main: before the fix main went on to serve)
    args = parser().parse_args([*base, "--enable-lora", "--lora-modules", f"ckpt={files['a']}"])
    with pytest.raises(ConfigError, match=r"the name is the served model's \('ckpt'"):
        build_engine(args)


def test_compiled_adapters_are_served_by_their_names(fake_rebel: Any, files: dict[str, Path],
                                                    references: dict[str, list[list[int]]],
                                                    tmp_path: Path, capsys: Any) -> None:
    """`--runtime rebel`: the adapters compiled into the artifact (the emulated rebel computes
    each row with its own) are served under their `lora_name` without `--enable-lora`; a
    `--lora-modules` name the artifact does not hold stops the server listing those it holds;
    load and unload are refused (compiled adapters are fixed)."""
    config = lora_config([lora_adapter(1, "a", files["a"]),
                          # optimum-rbln folds rsLoRA's 1/sqrt(r) as scaling_factor = r
                          lora_adapter(2, "b", files["b"], scaling_factor=8.0)])
    directory = compile_dir(tmp_path / "compiled", files["ckpt"], batch_size=4, max_seq_len=128,
                            kvcache_num_blocks=5, prefill_chunk_size=16, lora_config=config)
    line = ["--runtime", "rebel", "--model", str(directory), "--engine-core", "inline",
            "--port", "0"]
    assert main([*line, "--lora-modules", f"a={files['a']}", "sql=/adapters/sql"]) == 2
    err = capsys.readouterr().err
    assert "--lora-modules sql" in err and "(it holds: a, b)" in err, err
    app = create_app(Batcher(RebelRuntime.from_optimum(directory)), BASE, lora_updates=True)
    with ServerThread(app) as server, sdk(server.url) as client:
        cards = {card.id: card.model_extra for card in client.models.list()}
        assert list(cards) == [BASE, "a", "b"] and cards["a"]["parent"] == BASE
        for name in ("a", "b", BASE):
            for i, prompt in enumerate(PROMPTS):
                assert complete(server.url, name, prompt) == (name, references[name][i])
        load = httpx.post(f"{server.url}/v1/load_lora_adapter",
                          json={"lora_name": "c", "lora_path": str(files["c"])})
        assert load.status_code == 400 and "compiled" in load.text, load.text
        unload = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert unload.status_code == 400 and "compiled" in unload.text, unload.text
        assert [card.id for card in client.models.list()] == [BASE, "a", "b"]
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'vllm:lora_requests_info{max_lora="",' in metrics


def test_unload_is_refused_while_a_request_runs_under_the_adapter(files: dict[str, Path]) -> None:
    """With --max-cpu-loras 1 and "a" loaded, loading another is refused. A stream under
    adapter "a" is decoding (a paced decode: 20 ms a step): unloading "a"
    answers 400 `adapter_in_use` naming the request, and the stream goes on; once the client
    hangs up (the request is aborted), the unload succeeds."""
    spec = ModelSpec.from_pretrained(files["ckpt"])
    art = ArtifactConfig(model=spec, batch_size=2, max_seq_len=128, block_size=128,
                         num_blocks=3, prefill_chunk_size=32)
    batcher = Batcher(PacedDecode.from_pretrained(files["ckpt"], artifact=art))
    batcher.load_lora("a", str(files["a"]))
    app = create_app(batcher, BASE, enable_lora=True, lora_updates=True, max_cpu_loras=1)
    with ServerThread(app) as server, sdk(server.url) as client:
        full = httpx.post(f"{server.url}/v1/load_lora_adapter",
                          json={"lora_name": "c", "lora_path": str(files["c"])})
        assert full.status_code == 400 and full.json()["error"]["code"] == "too_many_adapters"
        stream = client.completions.create(model="a", prompt=PROMPTS[0], max_tokens=100,
                                           temperature=0.0, stream=True,
                                           extra_body={"ignore_eos": True})
        first = next(iter(stream))
        refused = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "adapter_in_use" and first.id in error["message"]
        assert len(list(itertools.islice(stream, 3))) == 3  # it streams on
        stream.close()
        deadline = time.monotonic() + 30
        while True:  # the hang-up aborts the request within a step or two
            unload = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "a"})
            if unload.status_code == 200:
                break
            assert unload.status_code == 400 and time.monotonic() < deadline, unload.text
            time.sleep(0.05)
        assert [card.id for card in client.models.list()] == [BASE]


class _Outbox:
    """Where a shared core's sender would take the loop's messages (the test reads them)."""

    def __init__(self) -> None:
        self.messages: list[Any] = []

    def put(self, message: Any) -> None:
        self.messages.append(message)


def _two_front_core(files: dict[str, Path]) -> tuple[CoreLoop, _Outbox]:
    """A core loop of two fronts over the checkpoint, its messages kept in an `_Outbox`."""
    spec = ModelSpec.from_pretrained(files["ckpt"])
    art = ArtifactConfig(model=spec, batch_size=2, max_seq_len=128, block_size=128,
                         num_blocks=3, prefill_chunk_size=32)
    outbox = _Outbox()
    loop = CoreLoop(Batcher(NumpyRuntime.from_pretrained(files["ckpt"], artifact=art)),
                    [None, None], outbox, os.getpid(), routes={})
    return loop, outbox


def _answer_index(loop: CoreLoop, outbox: _Outbox, seq: int) -> int:
    """Run the loop until the answer to load/unload `seq` is sent; its index in the outbox."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        loop.take(50)
        loop.hand_over()
        for i, m in enumerate(outbox.messages):
            if isinstance(m, To) and isinstance(m.message, LoraDone) and m.message.seq == seq:
                return i
    raise AssertionError(f"no answer to {seq}: {outbox.messages}")


def test_a_shared_core_tells_every_front_of_each_change(files: dict[str, Path]) -> None:
    """`--api-server-count N`: a load or unload one front asked for reaches every front (a
    `LoraDone` with seq 0, which the sender gives to all) before the asking front's answer (a
    `To` that front); a refused load changes nothing and tells nobody else."""
    loop, outbox = _two_front_core(files)

    def until_answered(seq: int) -> int:
        return _answer_index(loop, outbox, seq)

    def told_everyone() -> list[list[str]]:
        return [m.loras for m in outbox.messages if isinstance(m, LoraDone) and m.seq == 0]

    try:
        loop.apply(LoadLora(1, "bad", str(files["c"] / "missing")), front=0)
        assert outbox.messages[until_answered(1)].front == 0
        assert told_everyone() == []
        loop.apply(LoadLora(2, "c", str(files["c"])), front=1)
        answer = until_answered(2)
        assert outbox.messages[answer].front == 1
        assert told_everyone() == [["c"]]
        assert next(i for i, m in enumerate(outbox.messages) if isinstance(m, LoraDone)) < answer
        loop.apply(UnloadLora(3, "c"), front=0)
        until_answered(3)
        assert told_everyone() == [["c"], []]
    finally:
        loop.lora.close()


def test_the_core_holds_max_cpu_loras_across_fronts(files: dict[str, Path]) -> None:
    """Review: `--max-cpu-loras` was checked by each front against the adapters it knew, so two
    fronts of a shared core loading at once both passed the check and the core loaded past the
    cap. The core counts every front's loads: of two loads queued together with a cap of 1, the
    second is refused and names the flag; an unload makes room again."""
    loop, outbox = _two_front_core(files)

    def answer(seq: int) -> LoraDone:
        done = outbox.messages[_answer_index(loop, outbox, seq)].message
        assert isinstance(done, LoraDone)
        return done

    try:
        # both fronts saw no adapter loaded when they asked
        loop.apply(LoadLora(1, "c", str(files["c"]), max_loaded=1), front=0)
        loop.apply(LoadLora(2, "d", str(files["a"]), max_loaded=1), front=1)
        first, second = answer(1), answer(2)
        assert first.error is None and first.loras == ["c"]
        assert second.error is not None and "max_cpu_loras=1" in second.error, second
        assert second.loras == ["c"] and sorted(loop.lora.loras()) == ["c"]
        loop.apply(UnloadLora(3, "c"), front=0)
        answer(3)
        loop.apply(LoadLora(4, "d", str(files["a"]), max_loaded=1), front=1)
        assert answer(4).error is None and loop.lora.loras() == ["d"]
    finally:
        loop.lora.close()

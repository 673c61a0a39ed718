"""A `vllm serve` launch line on `python -m atombatch.serve` (issue 39, item 3).

docs/from-vllm.md's flag table covers every flag of the lists read from the vLLM 0.34.0 and
0.30.0 and vllm-rbln 0.12.0 wheels (docs/vllm-flags/), and the server's parser does, flag by
flag, what the table says: an honoured flag is the parser's own, an accepted one parses with its
vLLM arity and warns once with the table's reason, a refused one exits 2 naming the flag and the
reason. Then the flags that ride along: TLS through uvicorn with certificates made here,
request logs and access lines off unless --enable-log-requests, messages in the user's spelling.
"""

from __future__ import annotations

import argparse
import json
import re
import ssl
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.served import served

from atombatch.serve import vllm_flags
from atombatch.serve.cli import main, parser

ROOT = Path(__file__).resolve().parents[2]
LISTS = sorted((ROOT / "docs" / "vllm-flags").glob("*.txt"))
DOC = ROOT / "docs" / "from-vllm.md"


def listed(path: Path) -> dict[str, str]:
    """flag -> arity of one list."""
    return {line.split()[0]: line.split()[1] for line in path.read_text().splitlines()
            if line and not line.startswith("#")}


def doc_table() -> dict[str, tuple[str, str]]:
    """flag -> (fate, why) of docs/from-vllm.md's table."""
    text = DOC.read_text().split("<!-- flags:start -->")[1].split("<!-- flags:end -->")[0]
    rows = {}
    for line in text.splitlines():
        match = re.match(r"\| `([^`]+)` \| [^|]+ \| ([^|]+) \| ([^|]+) \|$", line)
        if match:
            rows[match[1]] = (match[2].strip(), match[3].strip())
    return rows


TABLE = doc_table()
ARITY = {flag: arity for path in LISTS for flag, arity in listed(path).items()}
ARITY.update({"--disable-log-requests": "switch", "-O": "optional"})  # in no list
SAMPLE = {"switch": [], "optional": [], "value": ["7"], "values": ["7"]}


def line(model: str, *flags: str) -> list[str]:
    """The model after the flags (their arity must leave it alone), or, behind a flag taking
    one or more values or an optional one (which takes the words after it, in vLLM too),
    before them."""
    return [model, *flags] if ARITY.get(flags[0]) in ("values", "optional") else [*flags, model]


def test_the_lists_are_the_wheels_and_the_table_covers_them() -> None:
    names = {path.name for path in LISTS}
    assert names == {"vllm-0.34.0.txt", "vllm-0.30.0.txt", "vllm-rbln-0.12.0.txt"}
    sizes = {path.name: len(listed(path)) for path in LISTS}
    assert sizes["vllm-0.34.0.txt"] > 400 and sizes["vllm-0.30.0.txt"] > 350
    for common in ("--max-model-len", "--gpu-memory-utilization", "--dtype", "--ssl-keyfile",
                   "--trust-remote-code", "--enable-chunked-prefill", "--uvicorn-log-level",
                   "--max-num-batched-tokens", "--no-enable-prefix-caching", "-tp"):
        assert common in listed(LISTS[0]) and common in listed(LISTS[1]), common
    lists = {flag for path in LISTS for flag in listed(path)}
    missing = sorted(lists - set(TABLE))
    assert not missing, f"docs/from-vllm.md's table lacks {missing}"
    extra = sorted(set(TABLE) - lists)
    assert extra == ["--disable-log-requests", "-O"]  # earlier vLLMs' spelling; -O3
    assert set(TABLE) == set(vllm_flags.FLAGS)


PARSER = parser()  # parsing leaves a parser as it was: one for every case


def parse(*argv: str) -> argparse.Namespace:
    return PARSER.parse_args(list(argv))


@pytest.mark.parametrize("flag", sorted(TABLE), ids=sorted(TABLE))
def test_the_parser_does_what_the_table_says(flag: str, capsys: Any, tmp_path: Path) -> None:
    fate, why = TABLE[flag]
    ours = PARSER._option_string_actions
    model = str(tmp_path)
    if fate == "honoured":
        assert flag in ours, f"{flag} is honoured but the parser lacks it"
        if "the same flag" not in why and not why.startswith("as `"):
            args = parse(*line(model, flag, *SAMPLE[ARITY[flag]]))
            assert vllm_flags.warnings(args) == {} and args.model == model
        elif why.startswith("as `"):
            assert why[4:-1] in ours[flag].option_strings
    elif fate == "accepted, one warning":
        args = parse(*line(model, flag, *SAMPLE[ARITY[flag]], flag, *SAMPLE[ARITY[flag]]))
        assert vllm_flags.warnings(args) == {flag: why}  # given twice, warned once
        assert args.model == model
    elif fate == "refused":
        with pytest.raises(SystemExit) as info:
            parse(flag, *SAMPLE[ARITY[flag]], model)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"error: {flag}" in err and why in err
    else:
        allowed = re.findall(r"`([^`]+)`", fate)
        assert fate.endswith("; else refused") and allowed
        for value in allowed:
            args = parse(flag, value, model)
            assert vllm_flags.warnings(args) == {} and args.model == model
        other = "2" if all(v.isdigit() for v in allowed) else "other-value"
        with pytest.raises(SystemExit) as info:
            parse(flag, other, model)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"error: {flag} {other}: " in err and why in err


def test_a_vllm_rbln_launch_line_starts_with_three_warnings(capsys: Any, caplog: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch line of a vllm-rbln 0.12 script parses as vLLM reads it; its three flags with
    no meaning here warn once each, at startup, in the log, and so does a VLLM_RBLN_* variable
    of its environment."""
    monkeypatch.setenv("VLLM_RBLN_USE_VLLM_MODEL", "1")
    argv = ["--max-model-len", "128", "--block-size", "128", "--max-num-seqs", "2",
            "--max-num-batched-tokens", "64", "--enable-chunked-prefill",
            "--gpu-memory-utilization", "0.9", "--dtype", "auto", "--trust-remote-code",
            "--disable-log-requests", "--uvicorn-log-level", "warning", "--enforce-eager",
            "--no-enable-prefix-caching", "--served-model-name", "koni", "--seed", "3",
            "--tensor-parallel-size", "1", "--pipeline-parallel-size", "1"]
    args = parse(*argv)
    assert (args.max_seq_len, args.block_size, args.batch_size, args.prefill_chunk_size) == \
        (128, 128, 2, 64)
    assert args.served_model_name == "koni" and args.prefix_cache is False
    assert args.uvicorn_log_level == "warning" and args.enable_log_requests is False
    assert set(vllm_flags.warnings(args)) == {"--gpu-memory-utilization",
                                              "--trust-remote-code", "--enforce-eager"}
    # a port already taken stops main() right after the warnings: they come first, once each
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main([*argv, "--port", str(taken.getsockname()[1]),
                     "--log-format", "json"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    events = [json.loads(r.getMessage()) for r in caplog.records
              if r.getMessage().startswith("{")]
    events = [e for e in events if e["event"] in ("flag.ignored", "env.ignored")]
    assert [(e["event"], e.get("flag", e.get("name"))) for e in events] == [
        ("flag.ignored", "--gpu-memory-utilization"), ("flag.ignored", "--trust-remote-code"),
        ("flag.ignored", "--enforce-eager"), ("env.ignored", "VLLM_RBLN_USE_VLLM_MODEL")]
    assert events[0]["reason"] == TABLE["--gpu-memory-utilization"][1]
    assert lines[-1].startswith("atombatch.serve: cannot listen on")


def test_messages_name_the_flag_the_user_typed(capsys: Any) -> None:
    assert main(["--max-model-len", "100", "--block-size", "64"]) == 2
    err = capsys.readouterr().err
    assert "--max-model-len 100 must be a multiple of --block-size 64" in err
    assert "max_seq_len" not in err
    assert main(["--max-model-len", "262144"]) == 2
    assert "--max-model-len 262144 exceeds the model's max_position_embeddings" in \
        capsys.readouterr().err
    assert main(["--max-num-seqs", "2", "--max-model-len", "128",
                 "--num-gpu-blocks-override", "2"]) == 2
    err = capsys.readouterr().err
    assert "--num-gpu-blocks-override 2 breaks the lanes+1 rule: --max-num-seqs 2" in err
    assert "num_blocks" not in err and "batch_size" not in err
    # atombatch's own spelling is named as typed too; a field no flag set keeps its name
    assert main(["--max-seq-len", "100", "--block-size", "64"]) == 2
    assert "--max-seq-len 100 must be a multiple of --block-size 64" in capsys.readouterr().err
    assert main(["--max-seq-len", "128", "--decoder-batch-sizes", "1,2"]) == 2
    assert "decoder_batch_sizes=(1, 2) must lie in 1..batch_size=4" in capsys.readouterr().err


def test_help_names_the_key_and_tls() -> None:
    text = parser().format_help()
    assert "no authentication" not in text.replace("else no authentication", "")
    assert "--api-key" in text and "--ssl-certfile" in text
    assert "--gpu-memory-utilization" not in text  # the accepted flags stay out of --help


def test_api_keys_as_vllm_takes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    args = parse("--api-key", "k1", "k2", "--api-key", "k3", "--max-model-len", "64")
    assert args.api_key == ["k1", "k2", "k3"] and args.model is None


def test_tls_errors_are_one_line_at_startup(tmp_path: Path, capsys: Any) -> None:
    from support.tls import make_pki

    pki = make_pki(tmp_path)
    for argv, words in [
        (["--ssl-keyfile", str(pki.server_key)], "--ssl-keyfile needs --ssl-certfile"),
        (["--ssl-ca-certs", str(pki.ca)], "--ssl-ca-certs needs --ssl-keyfile and --ssl-certfile"),
        (["--ssl-keyfile", str(pki.client_key), "--ssl-certfile", str(pki.server_cert)],
         f"--ssl-certfile {pki.server_cert} / --ssl-keyfile {pki.client_key}: "),
        (["--ssl-keyfile", str(pki.server_key), "--ssl-certfile", str(tmp_path / "none.pem")],
         "no such file"),
        (["--ssl-keyfile", str(pki.server_key), "--ssl-certfile", str(pki.server_cert),
          "--ssl-cert-reqs", "2"], "--ssl-cert-reqs 2 needs --ssl-ca-certs"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("atombatch.serve: ") and words in err[0], err


def test_https_with_a_certificate_made_here(tmp_path: Path) -> None:
    """The server speaks TLS with the given key and certificate (checked against the CA made
    here), answers as over HTTP, and with --ssl-cert-reqs 2 serves only clients whose
    certificate the CA signed."""
    from support.tls import make_pki

    pki = make_pki(tmp_path)
    trust = ssl.create_default_context(cafile=str(pki.ca))
    tls = ["--ssl-keyfile", str(pki.server_key), "--ssl-certfile", str(pki.server_cert),
           "--max-model-len", "64", "--max-num-seqs", "1", "--engine-core", "inline"]
    with served(*tls, verify=trust) as (url, _):
        assert url.startswith("https://")
        r = httpx.post(f"{url}/v1/completions", verify=trust, timeout=60, json={
            "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        with pytest.raises(httpx.TransportError):  # plain HTTP is not spoken
            httpx.get(url.replace("https", "http") + "/health", timeout=10)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{url}/health", timeout=10)  # the system's CAs do not know it

    def client(cert: bool) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(pki.ca))
        if cert:
            context.load_cert_chain(str(pki.client_cert), str(pki.client_key))
        return context

    mutual = [*tls, "--ssl-ca-certs", str(pki.ca), "--ssl-cert-reqs", "2"]
    with served(*mutual, verify=client(True)) as (url, _):
        assert httpx.get(f"{url}/health", verify=client(True), timeout=10).status_code == 200
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", verify=client(False), timeout=10).raise_for_status()


@pytest.mark.parametrize("logged", [False, True], ids=["default", "enable-log-requests"])
def test_requests_are_logged_only_when_asked(tmp_path: Path, logged: bool) -> None:
    """vLLM 0.34's default: no line per request (neither the engine's request.finished nor
    uvicorn's access line); --enable-log-requests turns both on. Every engine-core mode."""
    for mode, fronts in (("inline", "1"), ("process", "1"), ("process", "2")):
        log = tmp_path / f"{mode}-{fronts}.log"
        flags = ["--max-model-len", "64", "--max-num-seqs", "1", "--engine-core", mode,
                 "--api-server-count", fronts, "--log-level", "info", "--log-format", "json"]
        if logged:
            flags.append("--enable-log-requests")
        with log.open("w") as sink, served(*flags, stderr=sink) as (url, _):
            r = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200
        events = [json.loads(line) for line in log.read_text().splitlines()
                  if line.startswith("{")]
        names = [e["event"] for e in events]
        assert "core.ready" in names or mode == "inline"  # the log itself is there
        finished = [e for e in events if e["event"] == "request.finished"]
        access = [e for e in events if e.get("logger") == "uvicorn.access"]
        assert len(finished) == logged, (mode, fronts, names)
        assert bool(access) == logged, (mode, fronts, names)
        if logged:
            assert any("/v1/completions" in e["event"] for e in access)


def test_uvicorn_log_level_is_uvicorns_alone(tmp_path: Path) -> None:
    """--uvicorn-log-level warning silences uvicorn's info records (its startup lines, the access
    lines) and leaves atombatch's events at --log-level."""
    log = tmp_path / "server.log"
    with log.open("w") as sink, served("--max-model-len", "64", "--max-num-seqs", "1",
                                       "--engine-core", "inline", "--enable-log-requests",
                                       "--uvicorn-log-level", "warning", "--log-level", "info",
                                       "--log-format", "json", stderr=sink) as (url, _):
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200
    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    assert [e["event"] for e in events if e["event"] == "request.finished"] == \
        ["request.finished"]
    assert not [e for e in events if str(e.get("logger", "")).startswith("uvicorn")]


def test_logprobs_mode_reaches_the_engine() -> None:
    """--logprobs-mode processed_logprobs reports the distribution sampled from: at temperature
    2 the sampled token's logprob differs from the raw one, while the token is the same."""
    from atombatch import SamplingParams
    from atombatch.serve.cli import build_engine

    params = SamplingParams(temperature=2.0, seed=5, logprobs=0, max_tokens=1, ignore_eos=True)
    found = {}
    for mode in ("raw_logprobs", "processed_logprobs"):
        batcher, _, _ = build_engine(parse("--max-model-len", "64", "--logprobs-mode", mode))
        (done,) = batcher.generate([[5, 6, 7]], params)
        assert done.logprobs is not None
        found[mode] = done.logprobs[0]
    raw, processed = found["raw_logprobs"], found["processed_logprobs"]
    assert raw.token_id == processed.token_id
    assert abs(raw.logprob - processed.logprob) > 1e-3


def test_lora_modules_in_vllms_two_spellings(capsys: Any) -> None:
    """`--lora-modules` as vLLM's `LoRAParserAction` reads it: `name=path` (a `=` and no `,`),
    else a JSON object; empty words skipped; a bad word exits 2 naming it; and the LoRA flags'
    values and defaults are vLLM's."""
    from atombatch.serve.lora import LoraModule

    args = parse("--enable-lora", "--lora-modules", "sql=/a/sql", "",
                 '{"name": "chat", "path": "/a/chat", "base_model_name": "m"}',
                 "eq=/a/x=y", "--max-loras", "3", "--max-lora-rank", "64")
    assert args.lora_modules == [LoraModule("sql", "/a/sql"),
                                 LoraModule("chat", "/a/chat", base_model_name="m"),
                                 LoraModule("eq", "/a/x=y")]
    assert (args.enable_lora, args.max_loras, args.max_lora_rank) == (True, 3, 64)
    defaults = parse()
    assert (defaults.enable_lora, defaults.lora_modules, defaults.max_loras,
            defaults.max_lora_rank) == (False, None, 1, 16)
    assert parse("--no-enable-lora").enable_lora is False
    for word, said in (("a=b,c", "Invalid JSON format for --lora-modules: a=b,c"),
                       ('{"name": "x"}', "Invalid fields for --lora-modules"),
                       ('{"name": "x", "path": "p", "rank": 4}', "Invalid fields"),
                       ('{"name": 5, "path": "p"}', "Invalid fields"),
                       ("=p", "is empty"), ("x=", "the path is empty")):
        with pytest.raises(SystemExit) as caught:
            parse("--lora-modules", word)
        assert caught.value.code == 2
        assert said in capsys.readouterr().err, word
    with pytest.raises(SystemExit):
        parse("--max-lora-rank", "12")  # vLLM's ranks only
    assert "invalid choice" in capsys.readouterr().err


def test_lora_flags_refused_at_startup_name_why(capsys: Any) -> None:
    """A launch line whose LoRA flags cannot work stops before anything loads (status 2)."""
    for line_, said in ((["--lora-modules", "a=/x"], "add --enable-lora"),
                        (["--runtime", "null", "--enable-lora"], "loads no adapters"),
                        (["--enable-lora", "--max-loras", "0"], "--max-loras 0 must be >= 1"),
                        (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"],
                         "--max-cpu-loras 2 must be >= --max-loras 4"),
                        (["--enable-lora", "--served-model-name", "m", "--lora-modules", "m=/x"],
                         "the served model's"),
                        (["--lora-dtype", "float16"], "--lora-dtype float16: vLLM's flag is "
                                                      "refused")):
        code: Any
        try:
            code = main(["--port", "0", *line_])
        except SystemExit as exc:
            code = exc.code
        assert code == 2, line_
        assert said in capsys.readouterr().err, line_

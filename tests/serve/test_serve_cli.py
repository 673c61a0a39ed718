"""`python -m atombatch.serve` as a user meets it: messages for bad flags, the startup line only
once the port is bound, a clear error for an address in use, and chat templates named at startup
(a broken one is one line and exit status 2)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from atombatch import SamplingParams
from atombatch.serve.cli import build_engine, main, parser


def tokenizer_dir(path: Path, template: str | None) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "w1"}))
    if template is not None:
        (path / "chat_template.jinja").write_text(template)
    return path


def one_error_line(capsys: Any) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("atombatch.serve: ")
    return lines[0]


def test_model_flags_say_what_is_wrong(capsys: Any, tmp_path: Path) -> None:
    assert main(["--model", "/nonexistent/ckpt"]) == 2
    line = one_error_line(capsys)
    assert "/nonexistent/ckpt: the path does not exist" in line and "preset" not in line
    (tmp_path / "file").write_text("x")
    assert main(["--model", str(tmp_path / "file")]) == 2
    assert "is not a directory" in one_error_line(capsys)
    assert main(["--model", "llama-9000"]) == 2
    assert "neither a checkpoint directory nor a preset (gemma3-1b, koni-8b" in \
        one_error_line(capsys)
    assert main(["--max-seq-len", "262144"]) == 2
    assert "--max-seq-len 262144 exceeds the model's max_position_embeddings=131072" in \
        one_error_line(capsys)


def test_policy_values_are_listed_and_checked(capsys: Any) -> None:
    text = parser().format_help()
    for value in ("stall-free:K", "prefill-first", "decode-first", "interleave:N", "fill-first:N"):
        assert value in text
    with pytest.raises(SystemExit) as info:
        parser().parse_args(["--policy", "fastest"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "'fastest' is not a policy: use one of stall-free:K, prefill-first, decode-first" in err
    args = parser().parse_args(["--policy", "fill-first:3", "--max-seq-len", "128"])
    batcher, _, _ = build_engine(args)
    assert batcher.policy.label == "fill-first:3"
    batcher, _, _ = build_engine(parser().parse_args(["--max-seq-len", "128"]))
    assert batcher.policy.label == "stall-free:8"  # the default


def test_address_in_use_is_one_line_and_no_banner(capsys: Any) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        assert main(["--port", str(port), "--max-seq-len", "128"]) == 2
        line = one_error_line(capsys)
        assert line == f"atombatch.serve: cannot listen on 127.0.0.1:{port}: address already in use"
    finally:
        taken.close()


def test_banner_comes_once_the_server_answers(tmp_path: Path) -> None:
    tokenizer_dir(tmp_path, "{% for m in messages %}w3 {{ m.content }} {% endfor %}w5")
    proc = subprocess.Popen(
        [sys.executable, "-m", "atombatch.serve", "--port", "0", "--max-seq-len", "128",
         "--batch-size", "1", "--tokenizer", str(tmp_path), "--log-level", "warning"],
        stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 120
        banner = ""
        while "listening on" not in banner:
            assert time.monotonic() < deadline, "no banner"
            banner = proc.stderr.readline()
            assert banner or proc.poll() is None, "the server exited"
        assert "chat template chat_template.jinja" in banner
        url = banner.rsplit(" ", 1)[1].strip()
        assert not url.endswith(":0")
        # The banner promises a running server: the first request already succeeds.
        assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "w10 w11"}], "max_tokens": 2})
        assert chat.json()["usage"]["prompt_tokens"] == 4  # w3 w10 w11 w5
    finally:
        proc.terminate()
        proc.wait(30)
        if proc.stderr is not None:
            proc.stderr.close()


def test_a_broken_template_is_one_line_at_startup(capsys: Any, tmp_path: Path) -> None:
    tokenizer_dir(tmp_path, "{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    assert main(["--tokenizer", str(tmp_path), "--max-seq-len", "128"]) == 2
    line = one_error_line(capsys)
    assert line.startswith("atombatch.serve: chat template chat_template.jinja line 2: ")


def test_chat_template_flag_overrides_the_tokenizers(tmp_path: Path) -> None:
    tokenizer_dir(tmp_path, "{{ bos_token }}")
    override = tmp_path / "mine.jinja"
    override.write_text("{{ bos_token }} {% for m in messages %}{{ m.content }} {% endfor %}w9")
    args = parser().parse_args(["--tokenizer", str(tmp_path), "--max-seq-len", "128",
                                "--chat-template", str(override)])
    _, _, codec = build_engine(args)
    assert codec is not None and codec.chat_template_name == str(override)
    assert codec.render_chat([{"role": "user", "content": "w7"}]) == [1, 7, 9]
    args = parser().parse_args(["--max-seq-len", "128", "--chat-template", str(override)])
    with pytest.raises(Exception, match="--chat-template needs a tokenizer"):
        build_engine(args)


def test_decoder_batch_sizes_flag_builds_a_bucketed_engine(capsys: Any) -> None:
    args = parser().parse_args(["--max-seq-len", "128", "--decoder-batch-sizes", "1,2,4"])
    batcher, _, _ = build_engine(args)
    assert batcher.runtime.artifact.decoder_batch_sizes == (1, 2, 4)
    done = batcher.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0,
                                                        ignore_eos=True))
    assert len(done[0].token_ids) == 3 and batcher.stats().bucket_steps == {1: 2}
    assert main(["--max-seq-len", "128", "--decoder-batch-sizes", "1,2"]) == 2
    assert "decoder_batch_sizes=(1, 2) must lie in 1..batch_size=4 and include batch_size" in \
        one_error_line(capsys)
    with pytest.raises(SystemExit):
        parser().parse_args(["--decoder-batch-sizes", "one"])
    assert "'one' is not a comma list of batch sizes" in capsys.readouterr().err


def test_the_context_defaults_to_the_models_and_a_larger_one_stays_an_error(
        tmp_path: Path, capsys: Any) -> None:
    from support import hf_models

    checkpoint = hf_models.save_checkpoint("llama", tmp_path / "ckpt", "float32")
    assert json.loads((checkpoint / "config.json").read_text())["max_position_embeddings"] == 512
    batcher, _, _ = build_engine(parser().parse_args(["--model", str(checkpoint)]))
    assert batcher.artifact.max_seq_len == 512 and batcher.artifact.block_size == 512
    # no checkpoint: the built-in spec's 131072 positions, capped for host memory
    batcher, _, _ = build_engine(parser().parse_args([]))
    assert batcher.artifact.max_seq_len == 1024
    assert main(["--model", str(checkpoint), "--max-seq-len", "1024"]) == 2
    assert "--max-seq-len 1024 exceeds the model's max_position_embeddings=512" in \
        one_error_line(capsys)

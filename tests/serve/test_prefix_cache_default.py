"""The server's prefix cache is on by default wherever the artifact and runtime support it (as
vLLM), `--no-enable-prefix-caching` turns it off; where it cannot run the default stays off
quietly and an explicit `--enable-prefix-caching` is refused naming why."""

from __future__ import annotations

import pytest

from atombatch.errors import ConfigError
from atombatch.serve.cli import build_engine, parser

NULL = ("--runtime", "null", "--null-step-ms", "0")


def cache_on(*argv: str) -> bool:
    batcher, _, _ = build_engine(parser().parse_args([*NULL, *argv]))
    return batcher.scheduler.prefix is not None


def test_on_by_default_where_supported_and_the_flags_turn_it_off_and_on() -> None:
    assert cache_on()                                     # eager: one block per sequence
    assert cache_on("--max-seq-len", "256", "--block-size", "16")   # partitioned
    assert not cache_on("--no-enable-prefix-caching")
    assert not cache_on("--no-prefix-cache")              # atombatch's older spelling
    assert cache_on("--enable-prefix-caching") and cache_on("--prefix-cache")
    assert parser().parse_args([]).prefix_cache is None   # the default is decided per engine


@pytest.mark.parametrize(("argv", "why"), [
    # single-block mode: one lane, one block per sequence and no spare
    (("--batch-size", "1", "--max-seq-len", "256", "--block-size", "64", "--num-blocks", "4"),
     "single-block mode"),
    # a hybrid model keeps sliding-slot checkpoints in the host cache, which it does not have
    (("--model", "gemma3-1b", "--max-seq-len", "1024", "--batch-size", "2"), "host_cache_bytes"),
])
def test_off_quietly_where_unsupported_and_an_explicit_flag_is_refused(
        argv: tuple[str, ...], why: str) -> None:
    assert not cache_on(*argv)
    with pytest.raises(ConfigError, match=why):
        cache_on(*argv, "--enable-prefix-caching")

"""`python -m atombatch.bench device` against the emulated runtime: the report passes on a sound
device and fails when the device's KV copy is broken or missing, or (LoRA) when a device runs a
row with another row's adapter."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fakerebel.compiler import compile_dir, lora_adapter, lora_config
from support import lora_models
from support.hf_models import save_checkpoint

from atombatch.bench import device
from atombatch.bench.__main__ import main as bench_main


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {family: save_checkpoint(family, tmp_path_factory.mktemp(family))
            for family in ("llama", "gemma3")}


CASES = {
    "llama eager B4/k5 buckets 1,2,4": ("llama", dict(kvcache_num_blocks=5,
                                                      decoder_batch_sizes=[1, 2, 4])),
    "gemma3 flash B4 buckets 2,4": ("gemma3", dict(kvcache_block_size=32, kvcache_num_blocks=17,
                                                   decoder_batch_sizes=[2, 4])),
    "llama B1/k2": ("llama", dict(batch_size=1, kvcache_num_blocks=2)),
}


@pytest.mark.parametrize("case", CASES)
def test_report_passes_on_a_sound_device(fake_rebel, tmp_path, checkpoints, capsys, case):
    family, options = CASES[case]
    options = {"batch_size": 4, **options}
    d = compile_dir(tmp_path / "c", checkpoints[family], max_seq_len=128, prefill_chunk_size=16,
                    **options)
    out = tmp_path / "report.json"
    assert bench_main(["device", "--model", str(d), "--new-tokens", "6", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    b = options["batch_size"]
    assert f"| B1 vs bucketed B{b} | PASS |" in text
    assert "| copy-block | PASS |" in text and "max |dlogit| = 0" in text
    assert "| host round-trip | PASS |" in text
    assert "| host time per step | INFO | median" in text
    assert "_copy_kv_cache yes" in text and "`prefill`: input_ids [1, 16] int64" in text
    report = json.loads(out.read_text())
    assert [c["status"] for c in report["checks"]] == ["PASS", "PASS", "PASS", "INFO"]
    assert fake_rebel.KV_CALLS["_copy_kv_cache"] >= 1
    if family == "gemma3":   # the sliding slot went out and back through the host buffers
        assert fake_rebel.KV_CALLS["_fetch_kv_cache"] >= 1
        assert fake_rebel.KV_CALLS["_update_kv_cache"] >= 2


def test_a_broken_kv_copy_fails_the_report(fake_rebel, tmp_path, checkpoints, capsys,
                                           monkeypatch):
    d = compile_dir(tmp_path / "c", checkpoints["llama"], batch_size=4, max_seq_len=128,
                    kvcache_num_blocks=5)
    monkeypatch.setattr(fake_rebel.Runtime, "_copy_kv_cache", lambda self, s, d, n: None)
    assert device.main(["--model", str(d), "--new-tokens", "4"]) == 1
    text = capsys.readouterr().out
    assert "| copy-block | FAIL |" in text and "tokens differ" in text
    assert "| host round-trip | PASS |" in text


def test_a_lossy_host_write_fails_the_round_trip(fake_rebel, tmp_path, checkpoints, capsys,
                                                 monkeypatch):
    d = compile_dir(tmp_path / "c", checkpoints["llama"], batch_size=4, max_seq_len=128,
                    kvcache_num_blocks=5)
    update = fake_rebel.Runtime._update_kv_cache

    def lossy(self, host, block, offset, tokens, name):   # loses the first token of each write
        update(self, host, block, offset, tokens, name)
        self.model.cache(name)[block, :, offset] = 0

    monkeypatch.setattr(fake_rebel.Runtime, "_update_kv_cache", lossy)
    assert device.main(["--model", str(d), "--new-tokens", "4"]) == 1
    text = capsys.readouterr().out
    assert "| copy-block | PASS |" in text and "| host round-trip | FAIL |" in text


def test_a_missing_kv_method_is_named_in_the_report(fake_rebel, tmp_path, checkpoints, capsys,
                                                    monkeypatch):
    d = compile_dir(tmp_path / "c", checkpoints["llama"], batch_size=4, max_seq_len=128,
                    kvcache_num_blocks=5)
    monkeypatch.delattr(fake_rebel.Runtime, "_copy_kv_cache")
    assert device.main(["--model", str(d), "--new-tokens", "4"]) == 1
    text = capsys.readouterr().out
    assert "_copy_kv_cache MISSING" in text
    assert "| copy-block | FAIL | ConfigError: copy_block (prefix-cache copies) needs " \
           "rebel.Runtime._copy_kv_cache" in text


def test_a_directory_it_cannot_drive_exits_2(fake_rebel, tmp_path, checkpoints, capsys):
    d = compile_dir(tmp_path / "c", checkpoints["llama"], batch_size=4, max_seq_len=128,
                    kvcache_num_blocks=4)                  # B4 without the spare block
    assert device.main(["--model", str(d)]) == 2
    assert "lanes+1 rule" in capsys.readouterr().err


# -- LoRA rows (a directory compiled with lora_config) -----------------------------------------------
@pytest.fixture(scope="module")
def lora_directory_parts(tmp_path_factory, checkpoints):
    """The llama checkpoint's PEFT adapters (made by peft) as lora_config entries."""
    root = tmp_path_factory.mktemp("adapters")
    entries = []
    for i, name in enumerate(("attn-r4", "layer1-r16"), start=1):
        lora_models.save_adapter("llama", lora_models.CASES[name], root / name)
        entries.append(lora_adapter(i, name, root / name))
    return lora_config(entries)


def test_lora_rows_pass_on_a_sound_device(fake_rebel, tmp_path, checkpoints, capsys,
                                          lora_directory_parts):
    d = compile_dir(tmp_path / "c", checkpoints["llama"], batch_size=4, max_seq_len=128,
                    prefill_chunk_size=16, kvcache_num_blocks=5, decoder_batch_sizes=[1, 2, 4],
                    lora_config=lora_directory_parts)
    out = tmp_path / "report.json"
    assert bench_main(["device", "--model", str(d), "--new-tokens", "6", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| LoRA rows | PASS | 2 adapters and the base:" in text
    assert "- LoRA adapters: attn-r4 (id 1, r 4, " in text and "; layer1-r16 (id 2, r 16, " in text
    assert "2 of 2 adapters change the probe's tokens" in text
    assert "lora_int_ids [4] int32" in text
    report = json.loads(out.read_text())
    assert [c["status"] for c in report["checks"]] == ["PASS", "PASS", "PASS", "PASS", "INFO"]


def test_a_device_that_mixes_up_rows_fails_lora_rows(fake_rebel, tmp_path, checkpoints, capsys,
                                                     monkeypatch, lora_directory_parts):
    d = compile_dir(tmp_path / "c", checkpoints["llama"], batch_size=4, max_seq_len=128,
                    prefill_chunk_size=16, kvcache_num_blocks=5, lora_config=lora_directory_parts)
    real = fake_rebel._DeviceModel.lora_int_ids

    def first_rows_adapter(self, graph, named):        # every row runs row 0's adapter
        ids = real(self, graph, named)
        return None if ids is None else np.full_like(ids, ids[0])

    monkeypatch.setattr(fake_rebel._DeviceModel, "lora_int_ids", first_rows_adapter)
    assert device.main(["--model", str(d), "--new-tokens", "6"]) == 1
    assert "| LoRA rows | FAIL | adapter ids [" in capsys.readouterr().out

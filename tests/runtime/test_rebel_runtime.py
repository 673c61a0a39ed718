"""RebelRuntime without the SDK: a lazy import whose failure says how to install it.

Everything RebelRuntime does on a device is tested through the emulated `rebel` in
tests/runtime/test_device.py.
"""

from __future__ import annotations

import sys

import pytest
from fakerebel.compiler import compile_dir
from support.hf_models import save_checkpoint

from atombatch import ConfigError
from atombatch.runtime import RebelRuntime


def test_missing_sdk_raises_config_error_with_install_guidance(monkeypatch, tmp_path):
    d = compile_dir(tmp_path / "c", save_checkpoint("llama", tmp_path / "ckpt"), batch_size=1,
                    max_seq_len=128, kvcache_num_blocks=2)
    monkeypatch.setitem(sys.modules, "rebel", None)  # makes `import rebel` raise ImportError
    with pytest.raises(ConfigError, match="rebel-sdk is not installed.*pip install"):
        RebelRuntime.from_optimum(d)


def test_importing_the_runtime_module_does_not_import_rebel(monkeypatch):
    monkeypatch.delitem(sys.modules, "rebel", raising=False)
    import atombatch.runtime.rebel  # noqa: F401

    assert "rebel" not in sys.modules

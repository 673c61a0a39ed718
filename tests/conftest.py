"""Shared fixtures. `impl` runs a test against both block/lane cores (multidict's pattern)."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from types import ModuleType

import pytest


@pytest.fixture(params=["c", "py"])
def impl(request: pytest.FixtureRequest) -> Iterator[ModuleType]:
    """The compiled `atombatch._blocks` (id `c`) or the pure-Python twin `_blocks_py` (id `py`)."""
    name = "atombatch._blocks" if request.param == "c" else "atombatch._blocks_py"
    yield importlib.import_module(name)


@pytest.fixture
def fake_rebel(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The emulated rebel-sdk (`tests/fakerebel/rebel`) as `import rebel`, with no device state."""
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "fakerebel"))
    monkeypatch.delitem(sys.modules, "rebel", raising=False)
    rebel = importlib.import_module("rebel")
    rebel.reset()
    yield rebel
    rebel.reset()

"""Shared fixtures. `impl` runs a test against both block/lane cores (multidict's pattern)."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from types import ModuleType

import pytest


@pytest.fixture(autouse=True)
def _json_events() -> Iterator[None]:
    """Events in JSON for every test (tests decode them), also under `pytest -s` on a terminal,
    whose default would be console; a test that picks a format gets JSON back afterwards."""
    from atombatch import logs

    logs.configure("json")
    yield
    logs.configure("json")


@pytest.fixture(params=["c", "py"])
def impl(request: pytest.FixtureRequest) -> Iterator[ModuleType]:
    """The compiled `atombatch.kernel._blocks` (id `c`) or the pure-Python twin `_blocks_py` (id `py`)."""
    name = "atombatch.kernel._blocks" if request.param == "c" else "atombatch.kernel._blocks_py"
    yield importlib.import_module(name)


@pytest.fixture(params=["c", "py"])
def core(request, monkeypatch):
    """Run the scheduler on the compiled core (id `c`) and on its pure-Python twin (`py`)."""
    from atombatch.engine import scheduler as scheduler_module

    if request.param == "c":
        from atombatch.kernel import _blocks as impl
    else:
        from atombatch.kernel import _blocks_py as impl
    monkeypatch.setattr(scheduler_module.core, "BlockPool", impl.BlockPool)
    monkeypatch.setattr(scheduler_module.core, "LaneTable", impl.LaneTable)
    monkeypatch.setattr(scheduler_module.core, "SlidingSlots", impl.SlidingSlots)
    monkeypatch.setattr(scheduler_module.core, "DecodeInputs", impl.DecodeInputs)
    monkeypatch.setattr(scheduler_module.core, "PrefillInputs", impl.PrefillInputs)
    monkeypatch.setattr(scheduler_module.core, "StepKernel", impl.StepKernel)
    from atombatch.kernel import prefix as prefix_module  # the prefix index's table and digest pass

    monkeypatch.setattr(prefix_module, "PrefixTable", impl.PrefixTable)
    monkeypatch.setattr(prefix_module, "chain_digests", impl.chain_digests)
    return request.param


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

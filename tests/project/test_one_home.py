"""Issue 40, "one home per rule": each rule, default and shared struct is declared once, and the
names it was known by before still reach that one declaration (embedders import them)."""

from __future__ import annotations

from atombatch import engine, pd, pd_intake, reports
from atombatch.cluster import pd_pool, summary


def test_the_reports_live_in_one_leaf_and_their_old_homes_reexport_them() -> None:
    import atombatch
    assert atombatch.EngineStats is engine.EngineStats is reports.EngineStats
    assert pd_pool.ProducerState is reports.ProducerState
    assert summary.CacheSummary is reports.CacheSummary
    assert summary.check_summary_size is reports.check_summary_size
    assert summary.DEFAULT_SUMMARY_BITS == reports.DEFAULT_SUMMARY_BITS


def test_one_kv_source_protocol() -> None:
    assert engine.KVSource is pd_intake.KVSource is pd.KVSource
    assert engine.KVSource.__module__ == "atombatch.pd.source"

"""`python -m atombatch.bench spec`: the projection table, the crossover table and the measured
replay of n-gram drafts, in a small option set."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atombatch.bench import spec
from atombatch.bench.__main__ import main as bench_main


def test_bench_spec_prints_the_projection_the_crossover_and_the_measured_rows(
        tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "spec.json"
    assert bench_main(["spec", "--models", "koni-8b", "--acceptance", "0.2,0.8", "--drafts",
                       "1-4", "--max-batch", "8", "--texts", "summary,control",
                       "--measure-drafts", "4", "--prompt-lookup-min", "1",
                       "--prompt-lookup-max", "4", "--lookup-window", "8192",
                       "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "koni-8b      plain  -    1.000   7.7847  1.00x      253.93" in text
    assert "decode batch B at which plain decoding catches up" in text
    assert "calibration:" in text
    report = json.loads(out.read_bytes())
    rows = report["projected"]
    assert [r["acceptance"] for r in rows] == [None, 0.2, 0.8]
    assert rows[1]["gain"] < 1 < rows[2]["gain"]
    assert rows[2]["row"]["max_first_token_s"] < rows[0]["row"]["max_first_token_s"]
    assert [c["batch"] for c in report["crossover"]] == [1, 3]
    measured = {r["text"]: r for r in report["measured"]}
    # the summary quotes its source: drafts mostly accepted; shuffled words: mostly not
    assert measured["summary"]["acceptance_rate"] > 0.5 > measured["control"]["acceptance_rate"]
    assert measured["summary"]["tokens_per_call"] > 2 > measured["control"]["tokens_per_call"]
    assert measured["summary"]["koni_tok_s"] > 7.7847 > measured["control"]["koni_tok_s"]


def test_bench_spec_refuses_bad_options(capsys: Any) -> None:
    assert spec.main(["--acceptance", "1.5"]) == 2
    assert "--acceptance '1.5': rates must lie in [0, 1]" in capsys.readouterr().err
    assert spec.main(["--texts", "poetry"]) == 2
    assert "--texts 'poetry': not one of" in capsys.readouterr().err
    assert spec.main(["--drafts", "0-2"]) == 2
    assert "k must lie in 1..127" in capsys.readouterr().err
    assert spec.main(["--lookup-window", "0"]) == 2
    assert "--lookup-window 0 must lie in 1..8192" in capsys.readouterr().err


def test_replay_accepts_exactly_the_matching_prefix() -> None:
    prompt = np.array([1, 2, 3, 4, 1, 2], dtype=np.int64)
    reference = np.array([3, 4, 9, 9], dtype=np.int64)
    trace = spec.replay(prompt, reference, 3, 2, 1, window=64)
    # after "1 2 3" the proposer copies "4 1" (two drafts leave room for the model's token):
    # "4" accepted, "1" rejected, the model gives 9; one token left: no draft, a plain step
    assert trace == [(2, 1), (0, 0)]
    assert sum(a + 1 for _, a in trace) == len(reference) - 1


@pytest.mark.parametrize("case", [spec.summary_case, spec.code_edit_case])
def test_copy_cases_repeat_their_prompt(case: Any) -> None:
    prompt, reference = case()
    vocabulary = spec.Vocabulary()
    prompt_ids, reference_ids = vocabulary.encode(prompt), vocabulary.encode(reference)
    assert len(reference_ids) > 300
    # most reference tokens exist in the prompt's vocabulary (it copies)
    assert np.isin(reference_ids, prompt_ids).mean() > 0.9


def test_numpy_runtime_row_replays_the_runtimes_own_tokens() -> None:
    prompt, output = spec.numpy_case(output=24)
    assert len(output) == 24
    trace = spec.replay(prompt, output, 4, 4, 1)
    assert sum(a + 1 for _, a in trace) == len(output) - 1
    assert all(0 <= a <= p <= 4 for p, a in trace)

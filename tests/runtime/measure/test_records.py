"""ppdsl/runtime/measure/records.py: what `ppdsl profile` measured, its JSON
(`--json`) and its table (docs/runtime.md, "Profiling a model")."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from ppdsl.runtime.measure.records import StepCosts, write_json
from tests.runtime.measure.examples import small_profile


def test_json_derives_the_ratios_and_the_one_transfer_cost(tmp_path: Path) -> None:
    """`--json` states each stage's derived ratios (M_W/M_B, the split's overhead)
    and `comm_ms`: the measured boundaries' mean, or the pipeline's latency
    when the engine measured one; `write_json` writes the same."""
    profile = small_profile(3)
    report = profile.to_json()
    stage = report["stages"][0]
    assert stage["mw_over_mb"] == 0.5 and stage["bytes_ratio"] == 1.0
    assert stage["split_overhead"] == pytest.approx((1.25 + 2.5 + 1.125) / (1.2 + 3.5) - 1)
    assert report["comm_ms"] == 0.5 and report["step"] is None and report["memory_unit_bytes"] == 1000
    step = StepCosts(0.0625, {"F0": 1.0}, (1.0,) * 3, "adam", None, latency_ms=0.75)
    assert replace(profile, step=step).to_json()["comm_ms"] == 0.75
    write_json(profile, tmp_path / "p.json")
    assert json.loads((tmp_path / "p.json").read_text()) == json.loads(json.dumps(report))


def test_table_has_a_row_per_stage_and_only_the_measured_parts() -> None:
    """The table: a row per stage with its bytes; the collectives' lines only
    with `--dp` > 1, the step's lines only with step costs, a note for each
    stage the split leaves parameters to B."""
    plain = small_profile().table().splitlines()
    assert plain[0].startswith("m.py:f: 2 stages, microbatch 2, cpu (1 thread), fp32")
    assert [line.split()[0] for line in plain[2:4]] == ["0", "1"]
    assert plain[2].split()[6:8] == ["1000", "500"]
    assert not any(line.startswith(("collectives", "step besides", "note:")) for line in plain)
    base = small_profile()
    stages = (replace(base.stages[0], reduce_ms=0.25, gather_ms=0.5, param_bytes=64,
                      uncovered=("norm.weight",)), base.stages[1])
    step = StepCosts(0.0625, {"F0": 1.0}, (3.5, 4.25), "sgd", None)
    table = replace(base, stages=stages, dp=2, step=step).table()
    assert "stage 0: 64 parameter bytes: all-reduce 0.250 ms, all-gather 0.500 ms over 2 ranks" in table
    assert "sgd step 3.500, 4.250 ms per stage; norm all-reduce not measured" in table
    assert "every stage on one process" in table
    assert "note: stage 0: not split (gradient during B): norm.weight" in table

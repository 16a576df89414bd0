"""Data parallel x pipeline (docs/runtime.md): dp 2 x pp 2 on 4 gloo processes,
both modes, six schedules; every case in ONE process group
(tests/dist/dp_worker.py, started once by a module fixture)."""

from __future__ import annotations

import pickle
from fractions import Fraction
from pathlib import Path

import pytest

from tests.dist import harness

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
TOL = 1e-5
SCHEDULES = ["1f1b", "zb_h1", "zb_v", "v_half", "interleaved_1f1b", "looped_bfs"]
MODES = ["replicate", "shard"]


def _pickle(work: Path, name: str) -> str:
    from ppdsl.compiler import compile_file

    path = work / f"{name}.pickle"
    if not path.exists():
        compiled = compile_file(ROOT / "examples" / f"{name}.pp", {"d": "2"})
        path.write_bytes(pickle.dumps((compiled.schedule, compiled.programs)))
    return str(path)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("dp")
    cases = [{"id": f"{mode}-{name}", "pickle": _pickle(work, name), "model": "tiny:stages",
              "steps": 3, "dp": 2, "mode": mode}
             for mode in MODES for name in SCHEDULES]
    cases.append({"id": "clip-shard-zb_v", "pickle": _pickle(work, "zb_v"), "model": "tiny:stages",
                  "steps": 3, "dp": 2, "mode": "shard", "max_norm": 0.05})
    return harness.run_cases(cases, 4, work, worker="dp_worker.py")


def _case(results: dict, case_id: str) -> list[dict]:
    per_rank = results[case_id]
    errors = [r["error"] + "\n" + r.get("traceback", "") for r in per_rank if "error" in r]
    assert not errors, errors[0]
    return per_rank


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", SCHEDULES)
def test_dp_pp_equals_single_process(results: dict, mode: str, name: str) -> None:
    """dp 2 x pp 2: the parameters after 3 optimizer steps equal a single-process,
    non-pipelined run on the whole batch (each replica given its half) within
    1e-5; the peak activation memory measured on every rank equals the
    schedule's prediction (with the model's measured M_W)."""
    per_rank = _case(results, f"{mode}-{name}")
    assert sorted(r["replica"] for r in per_rank) == [0, 0, 1, 1]
    for r in per_rank:
        assert r["param_rel_err"] <= TOL, r
        # in the file's units, M_W set to the model's measured M_W/M_B (as
        # tests/test_runtime_dist.py); a fused backward frees all at once
        measured = Fraction(r["measured_peak"])
        assert measured == Fraction(r["predicted_peak_real_mw"]), r
        if name in ("1f1b", "interleaved_1f1b", "looped_bfs"):
            assert measured == Fraction(r["predicted_peak"]), r
    # the replicas of one pipeline rank hold the same parameters (replicate) or
    # their shards of the same parameters (shard: not the same digest)
    by_stages: dict = {}
    for r in per_rank:
        by_stages.setdefault(tuple(r["stages"]), []).append(r["digest"])
    for digests in by_stages.values():
        assert len(digests) == 2
        if mode == "replicate":
            assert digests[0] == digests[1]


def test_clipping_sums_the_norm_over_shards(results: dict) -> None:
    """shard mode: the global gradient norm sums every rank's shard (pipeline and
    DP groups); clipping by it gives the single-process run's parameters and
    norms."""
    for r in _case(results, "clip-shard-zb_v"):
        assert r["param_rel_err"] <= TOL, r
        for got, want in zip(r["outcomes"], r["ref_norms"], strict=True):
            assert abs(got - want) <= TOL * want, r

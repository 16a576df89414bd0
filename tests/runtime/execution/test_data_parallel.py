"""Data parallel x pipeline (docs/runtime.md): dp 2 x pp 2 on 4 gloo processes,
both modes, six schedules; every case in ONE process group
(tests/dist/dp_worker.py, started once by a module fixture)."""

from __future__ import annotations

import json
import os
import pickle
import re
import shlex
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from tests.dist import harness
from tests.paths import ROOT

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

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
    schedule's prediction (with the model's measured M_W); shard: no microbatch's
    forward finds its stage sharded (no regather), and every stage is resharded
    after each step's passes."""
    per_rank = _case(results, f"{mode}-{name}")
    assert sorted(r["replica"] for r in per_rank) == [0, 0, 1, 1]
    for r in per_rank:
        assert r["param_rel_err"] <= TOL, r
        # in the file's units, M_W set to the model's measured M_W/M_B (as
        # tests/system/test_pipeline_dist.py); a fused backward frees all at once
        measured = Fraction(r["measured_peak"])
        assert measured == Fraction(r["predicted_peak_real_mw"]), r
        if name in ("1f1b", "interleaved_1f1b", "looped_bfs"):
            assert measured == Fraction(r["predicted_peak"]), r
    if mode == "shard":  # gathered once per step, whole through every microbatch, then resharded
        for r in per_rank:
            assert r["forwards"] == 2 * 4 * len(r["stages"]) and r["sharded_at_forward"] == 0, r
            assert r["resharded_after_step"] == [True] * 3, r
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


def _readme_dp_lines() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [line for block in re.findall(r"```sh\n(.*?)```", text, flags=re.S)
            for line in block.splitlines() if line.startswith("ppdsl run") and "--dp" in line]


def test_readme_shows_both_modes() -> None:
    """The README's data-parallel command lines (run below) cover both modes."""
    lines = _readme_dp_lines()
    assert len(lines) == 2 and any("--dp-mode shard" in x for x in lines), lines


# The README's replicate line is not run again here: the group above proves
# replicate's training and memory on the same model and schedule, and
# tests/system/test_model_zoo.py trains `ppdsl run --dp 2 --dp-mode replicate`
# (parameters equal, losses equal a plain run's).
@pytest.mark.parametrize("mode", ["shard"])
def test_ppdsl_run_dp(tmp_path: Path, mode: str) -> None:
    """The README's `ppdsl run examples/zb_h1.pp -D d=2 -D m=4 --dp 2 --dp-mode
    shard ...` trains on 4 CPU processes: every rank reports the same per-step loss
    (the replicas' mean, all-reduced), the losses fall, the replicas of each
    pipeline rank end with the same parameters (sha256 of the whole, gathered,
    parameters), and the measured peak activation equals the prediction."""
    (line,) = [x for x in _readme_dp_lines() if ("--dp-mode shard" in x) == (mode == "shard")]
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    argv = [sys.executable, "-m", "ppdsl", *shlex.split(line)[1:], "--json", "out"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(4)]
    assert [(r["replica"], r["pp_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    losses = [r["losses"] for r in ranks]
    assert all(x == losses[0] for x in losses) and len(losses[0]) == 5
    values = [float.fromhex(v) for _, v in sorted(losses[0].items(), key=lambda kv: int(kv[0]))]
    assert values[-1] < values[0]
    for pp in (0, 1):
        assert ranks[pp]["whole_parameters_sha256"] == ranks[pp + 2]["whole_parameters_sha256"]
    assert proc.stdout.count("parameters equal") == 2, proc.stdout
    for r in ranks:
        assert Fraction(r["measured_peak"]) == Fraction(r["predicted_peak_real_mw"]), r

"""The runtime under real processes and real torch.distributed (gloo, loopback).

Every schedule case of a world size runs in ONE process group (tests/dist/worker.py,
started once per world size by a session fixture); the tests then assert on the
JSON each rank wrote.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from fractions import Fraction
from pathlib import Path

import pytest

from tests.dist import harness
from tests.dist.cases import build_cases, example_files
from tests.dist.orders import python_schedules

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
MODEL = str(ROOT / "examples" / "models" / "tiny_gpt.py") + ":stages"
TOL = 1e-5


CASES = [(d, p.stem) for d in (2, 4) for p in example_files()]
V_FILES = {"1f1b": "1f1b", "half": "v_half", "min": "v_min"}
FROZEN_FILES = ["1f1b", "zb_h1", "zb_v"]
DUALPIPE_RECOMPUTE = ROOT / "tests" / "dist" / "dualpipe_recompute.pp"


@pytest.fixture(scope="session")
def dist_results(tmp_path_factory: pytest.TempPathFactory):
    """{d: results by case id}, each world size run once, lazily."""
    cache: dict[int, dict] = {}

    def get(d: int) -> dict:
        if d not in cache:
            work = tmp_path_factory.mktemp(f"dist-d{d}")
            cases = build_cases(d, work)
            if d == 2:  # memory only, with the long-sequence model (M_W/M_B about 0.14)
                cases += build_cases(d, work, check_grads=False, factory="stages_long")
                # LoRA-style: frozen weights, split and fused backward schedules
                cases += build_cases(d, work, only=FROZEN_FILES, factory="stages_frozen")
                # DualPipe's lanes with recomputed stages (each lane's first)
                cases += build_cases(d, work, paths=[DUALPIPE_RECOMPUTE])
            if d == 4:  # graphs kept until W
                cases += build_cases(d, work, only=[V_FILES["half"], V_FILES["min"]],
                                     release="at-w")
                # two pipelines of 2 ranks, each in its own process group
                cases += build_cases(2, work, only=["zb_h1", "zb_v"], pipelines=2)
            cache[d] = harness.run_cases(cases, d, work)
        return cache[d]

    return get


def _case(dist_results, d: int, name: str) -> list[dict]:
    per_rank = dist_results(d)[f"{name}-d{d}"]
    errors = [r["error"] + "\n" + r.get("traceback", "") for r in per_rank if "error" in r]
    assert not errors, errors[0]
    return per_rank


@pytest.mark.parametrize(("d", "name"), CASES, ids=[f"{n}-d{d}" for d, n in CASES])
def test_step_equals_single_process(dist_results, d: int, name: str) -> None:
    """Loss, every parameter gradient after one step, and parameters after three
    SGD steps equal a single-process non-pipelined run within 1e-5 relative."""
    for r in _case(dist_results, d, name):
        assert abs(r["loss"] - r["ref_loss"]) <= TOL * abs(r["ref_loss"]), r
        assert r["grad_rel_err"] <= TOL, r
        assert r["param_rel_err"] <= TOL, r


@pytest.mark.parametrize(("d", "name"), CASES, ids=[f"{n}-d{d}" for d, n in CASES])
def test_measured_memory_equals_prediction(dist_results, d: int, name: str) -> None:
    """Measured peak activation per rank, in microbatch-stage units, equals the
    memory model's prefix-sum peak with M_W set to the model's measured M_W/M_B
    (and a recomputed stage's M_I to its measured M_I/M_B); for a fused backward
    without recomputation (nothing retained between B and W, nothing kept
    between F and R) it equals the file's prediction exactly."""
    for r in _case(dist_results, d, name):
        measured = Fraction(r["measured_peak"])
        assert measured == Fraction(r["predicted_peak_real_mw"]), r
        if not r["mw_ratio"] and not r["mi_ratio"]:  # fused, no recompute: the file's model
            assert measured == Fraction(r["predicted_peak"]), r
        assert r["measured_peak_bytes"] > 0


@pytest.mark.parametrize("d", [2, 4])
def test_recomputed_stages_keep_only_their_input(dist_results, d: int) -> None:
    """examples/1f1b_recompute.pp: on every rank the recomputed stage's F keeps
    under a tenth of what its R restores (its input, not its activations), and
    the measured peak is the prediction with that measured M_I, below 1F1B's."""
    plain = {r["rank"]: Fraction(r["measured_peak"]) for r in _case(dist_results, d, "1f1b")}
    for r in _case(dist_results, d, "1f1b_recompute"):
        assert [int(s) for s in r["mi_ratio"]] == r["stages"], r
        assert set(r["stages"]) <= set(r["recompute"]), r
        assert all(0 < Fraction(x) < Fraction(1, 10) for x in r["mi_ratio"].values()), r
        assert Fraction(r["measured_peak"]) == Fraction(r["predicted_peak_real_mw"]), r
        assert Fraction(r["measured_peak"]) <= plain[r["rank"]], r
        if r["rank"] == 0:  # 1F1B's first rank holds d whole activations, this one about 1
            assert Fraction(r["measured_peak"]) < Fraction(3, 2) < plain[0], (r, plain)


def test_dualpipe_lanes_with_recompute(dist_results) -> None:
    """tests/dist/dualpipe_recompute.pp (d=2): two lanes whose first stages (0 on
    rank 0, 2 on rank 1) recompute: the step equals the single-process run, each
    rank's recomputed stage keeps only its input, and the measured peak is the
    prediction with the measured M_I."""
    for r in _case(dist_results, 2, "dualpipe_recompute"):
        assert abs(r["loss"] - r["ref_loss"]) <= TOL * abs(r["ref_loss"]), r
        assert r["grad_rel_err"] <= TOL and r["param_rel_err"] <= TOL, r
        assert sorted(r["recompute"]) == [0, 2], r
        assert [int(s) for s in r["mi_ratio"]] == [s for s in r["stages"] if s % 2 == 0], r
        assert all(0 < Fraction(x) < Fraction(1, 10) for x in r["mi_ratio"].values()), r
        assert Fraction(r["measured_peak"]) == Fraction(r["predicted_peak_real_mw"]), r


NAMES_D2 = [name for d, name in CASES if d == 2]


@pytest.mark.parametrize("name", NAMES_D2)
def test_prediction_bounds_memory_when_b_frees_more(dist_results, name: str) -> None:
    """With tiny_gpt's long-sequence variant, whose measured M_W/M_B (about 0.14) is
    below every example's M_W, the compiler's predicted peak bounds the measured
    one on every rank, and the prediction with the measured M_W is exact."""
    per_rank = dist_results(2)[f"{name}-d2-stages_long"]
    assert not [r for r in per_rank if "error" in r], per_rank
    for r in per_rank:
        measured = Fraction(r["measured_peak"])
        assert measured <= Fraction(r["predicted_peak"]), r
        assert measured == Fraction(r["predicted_peak_real_mw"]), r


def _release_w(results: dict, key: str) -> list[dict]:
    per_rank = results[key]
    errors = [r["error"] + "\n" + r.get("traceback", "") for r in per_rank if "error" in r]
    assert not errors, errors[0]
    return per_rank


@pytest.mark.parametrize("kind", ["half", "min"])
def test_release_w_step_equals_single_process(dist_results, kind: str) -> None:
    """`--release at-w` (each microbatch-stage's graph kept until its W) trains the
    same: loss, gradients and parameters equal the non-pipelined run at d=4."""
    for r in _release_w(dist_results(4), f"{V_FILES[kind]}-d4-release-at-w"):
        assert abs(r["loss"] - r["ref_loss"]) <= TOL * abs(r["ref_loss"]), r
        assert r["grad_rel_err"] <= TOL, r
        assert r["param_rel_err"] <= TOL, r


@pytest.mark.parametrize("d", [4, 8])
def test_v_shape_memory_ratios(dist_results, tmp_path: Path, d: int) -> None:
    """At d=4 and d=8 the measured V-Half/1F1B and V-Min/1F1B peak ratios are the
    controllable-memory paper's ((d+2)//2)/d and ((d+4)//3)/d exactly, as are the
    files' predictions. Measured with `--release at-w` (graphs kept until W: the
    paper's accounting, M_W = M_B, which is also what the files declare); the
    measured M_W/M_B is then 1 on every stage, read off the tensors, not assumed."""
    files = V_FILES
    if d == 4:  # the d=4 cases already ran in the shared process group
        results = dist_results(4)
    else:  # memory only (one step, no reference run): 8 processes on few cores
        cases = build_cases(d, tmp_path, check_grads=False, only=[files["1f1b"]])
        cases += build_cases(d, tmp_path, check_grads=False,
                             only=[files["half"], files["min"]], release="at-w")
        results = harness.run_cases(cases, d, tmp_path)
    # A schedule's units are its own stages' M_B; a V-shape chunk is half a 1F1B
    # stage of the same model, so compare in units of the whole model's activation
    # per microbatch: peak / num_stages.
    peak = {}
    for key, stem in files.items():
        per_rank = _release_w(results, f"{stem}-d{d}" + ("" if key == "1f1b" else "-release-at-w"))
        if key != "1f1b":
            assert all(Fraction(x) == 1 for r in per_rank for x in r["mw_ratio"].values())
        stages = len({s for r in per_rank for s in r["stages"]})
        peak[key] = (
            max(Fraction(r["predicted_peak"]) for r in per_rank) / stages,
            max(Fraction(r["measured_peak"]) for r in per_rank) / stages,
            max(r["measured_peak_bytes"] for r in per_rank),
        )
    for key, expect in (("half", Fraction((d + 2) // 2, d)), ("min", Fraction((d + 4) // 3, d))):
        predicted = peak[key][0] / peak["1f1b"][0]
        measured = peak[key][1] / peak["1f1b"][1]
        in_bytes = peak[key][2] / peak["1f1b"][2]
        print(f"d={d} V-{key}/1F1B: paper {expect}, file {predicted}, measured {measured} "
              f"in M_B units, {in_bytes:.4f} in bytes")
        assert predicted == expect
        assert measured == expect


# -- start-up checks, failures, bad input (generated programs, real launches) -------


def _compiled_dir(tmp: Path, name: str, d: int = 2, m: int = 4) -> Path:
    from ppdsl.backend.codegen import generate, write
    from ppdsl.lowering.lower import lower

    schedule = next(s for s in python_schedules(d, m) if s.name == name)
    out = tmp / f"{name}-d{d}"
    write(generate(schedule, lower(schedule)), out)
    return out


def _all_text(results: list[harness.RankResult]) -> str:
    return "\n".join(r.stdout + r.stderr for r in results)


def test_world_size_mismatch_refused(tmp_path: Path) -> None:
    """Three processes for a two-rank schedule: every rank exits 1, saying so."""
    out = _compiled_dir(tmp_path, "one_f_one_b")
    results = harness.run([str(out / "launch.py"), "--model", MODEL], 3, timeout=60)
    assert all(r.returncode == 1 for r in results), _all_text(results)
    assert "compiled for 2 ranks" in _all_text(results)
    assert "Traceback" not in _all_text(results)


def test_fingerprint_mismatch_refused(tmp_path: Path) -> None:
    """Rank 1 runs a program from another compiled schedule: all ranks refuse to start."""
    a = _compiled_dir(tmp_path, "one_f_one_b")
    b = _compiled_dir(tmp_path, "gpipe")
    shutil.copy(b / "rank1.py", a / "rank1.py")
    results = harness.run([str(a / "launch.py"), "--model", MODEL, "--timeout", "20"], 2, timeout=60)
    text = _all_text(results)
    assert all(r.returncode == 1 for r in results), text
    assert "different compiled schedules" in text
    assert "Traceback" not in text


def test_missing_rank_at_start_up(tmp_path: Path) -> None:
    """Only rank 0 of 2 starts: it exits 1 within about the --timeout, saying the
    group did not form, with no traceback."""
    import subprocess

    out = _compiled_dir(tmp_path, "one_f_one_b")
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(harness.free_port()), OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(out / "launch.py"), "--model", MODEL,
                           "--timeout", "3"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "could not form the group of 2 ranks" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - t0 < 30


def _wait_for_step(proc, needle: str = "step    1/", limit: float = 60) -> str:
    seen = ""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen += line
        if needle in line:
            return seen
    raise AssertionError(f"rank 0 never printed a step line:\n{seen}")


@pytest.mark.parametrize(("how", "victim"), [("kill", 1), ("hang", 1), ("kill", 0)])
def test_dead_or_hung_rank_stops_everyone(tmp_path: Path, how: str, victim: int) -> None:
    """A rank killed (SIGKILL) or frozen (SIGSTOP) mid-training, including rank 0
    which hosts the store here: the other exits non-zero within the --timeout, with a
    message naming the victim."""
    out = _compiled_dir(tmp_path, "one_f_one_b")
    procs = harness.start([str(out / "launch.py"), "--model", MODEL, "--steps", "100000",
                           "--timeout", "5"], 2)
    other = procs[1 - victim]
    try:
        _wait_for_step(procs[0])
        os.kill(procs[victim].pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            other.wait(timeout=30)
        except Exception:
            pytest.fail(f"rank {1 - victim} still running 30 s after rank {victim} was {how}ed")
        elapsed = time.monotonic() - t0
        err = other.stderr.read()
        assert other.returncode != 0
        assert f"rank {victim}" in err, err
        assert "Traceback" not in err, err
        assert elapsed < 5 + 10, elapsed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()


BAD = ROOT / "tests" / "dist" / "bad_models.py"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "no/such/model.py:stages"], "no such file"),
        (["--model", f"{BAD}:wrong_stage_count"], "built 3 stages but the schedule has 2"),
        (["--model", MODEL, "--batch-size", "7"], "does not split into 4 microbatches"),
        (["--model", f"{BAD}:shape_mismatch"], "stage 1 (on rank 1) cannot take stage 0's output"),
    ],
    ids=["unknown-model", "stage-count", "batch-split", "shape-mismatch"],
)
def test_bad_input_clear_message_before_training(tmp_path: Path, args, message: str) -> None:
    """Bad --model, stage count, batch size or stage shapes: one clear message, every
    rank exits 1 before any step, no traceback."""
    out = _compiled_dir(tmp_path, "one_f_one_b")
    results = harness.run([str(out / "launch.py"), *args, "--timeout", "20"], 2, timeout=60)
    text = _all_text(results)
    assert all(r.returncode == 1 for r in results), text
    assert message in text, text
    assert "step " not in text and "Traceback" not in text, text
    assert text.count(message) == 1, text


def test_uncovered_parameters_named_before_training(tmp_path: Path) -> None:
    """Under a split schedule (ZB-H1-like), parameters the B/W split does not cover are
    named by each rank before the first step, and the run trains."""
    out = _compiled_dir(tmp_path, "zb_h1_like")
    results = harness.run([str(out / "launch.py"), "--model", f"{BAD}:uncovered", "--steps", "2",
                           "--timeout", "60"], 2, timeout=120)
    text = _all_text(results)
    assert all(r.returncode == 0 for r in results), text
    assert "rank 0: note: these parameters get their gradient during B" in text
    assert "stage 0: scale" in text and "stage 1: 0.scale" in text


# `ppdsl run` on an example trains as a user sees it (falling losses, the table,
# samples/s and tokens/s): tests/system/test_readme.py checks the README's own
# `ppdsl run examples/zb_v.pp ... tiny_gpt.py:stages` run for it.


@pytest.mark.parametrize("name", FROZEN_FILES)
def test_frozen_parameters_under_split_schedules(dist_results, name: str) -> None:
    """LoRA-style fine-tuning (issue 10): with tiny_gpt's attention, MLP and token
    embedding weights frozen, no frozen parameter gets a gradient on any rank under
    a split (ZB-H1, ZB-V) or fused (1F1B) schedule, and loss, the trainable
    gradients and all parameters after three SGD steps equal a single-process run
    with the same parameters frozen."""
    per_rank = dist_results(2)[f"{name}-d2-stages_frozen"]
    errors = [r["error"] + "\n" + r.get("traceback", "") for r in per_rank if "error" in r]
    assert not errors, errors[0]
    assert sum(r["frozen_parameters"] for r in per_rank) > 0
    for r in per_rank:
        assert abs(r["loss"] - r["ref_loss"]) <= TOL * abs(r["ref_loss"]), r
        assert r["grad_rel_err"] <= TOL and r["param_rel_err"] <= TOL, r


@pytest.mark.parametrize("name", ["zb_h1", "zb_v"])
def test_pipelines_in_their_own_process_groups(dist_results, name: str) -> None:
    """Four processes cut into two pipelines of two ranks, each runner given its
    own process group (as a data-parallel layer would): every transfer and
    collective stays inside its group, and each pipeline's loss, gradients and
    parameters after three steps equal the single-process run."""
    per_rank = dist_results(4)[f"{name}-d2-x2"]
    errors = [r["error"] + "\n" + r.get("traceback", "") for r in per_rank if "error" in r]
    assert not errors, errors[0]
    assert sorted((r["pipeline"], r["rank"]) for r in per_rank) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in per_rank:
        assert abs(r["loss"] - r["ref_loss"]) <= TOL * abs(r["ref_loss"]), r
        assert r["grad_rel_err"] <= TOL and r["param_rel_err"] <= TOL, r

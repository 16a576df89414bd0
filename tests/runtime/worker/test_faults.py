"""A killed job restarts by itself and loses nothing (docs/runtime.md,
"Checkpoints and restarts"): `ppdsl run --max-restarts 5 --checkpoint-dir D
--checkpoint-every 1` with a rank SIGKILLed at five points in turn ends bit for
bit where an uninterrupted run ends; interrupted saves are never resumed from; a
checkpoint of another run set-up is refused, naming what differs."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.paths import ROOT

TINY = str(ROOT / "examples" / "models" / "tiny_gpt.py")
LOGGED = str(ROOT / "tests" / "dist" / "restart_model.py") + ":logged"
STEPS = 4
_STEP_LINE = re.compile(r"^step\s+(\d+)/\d+\s+loss (\S+)", re.M)


def _run(tmp: Path, name: str, *extra: str, fault: str | None = None,
         schedule: str = "examples/zb_h1.pp", model: str = LOGGED,
         ) -> tuple[subprocess.CompletedProcess, Path]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PPDSL_TEST_BATCH_LOG=str(tmp / f"{name}.batches"))
    env.pop("PPDSL_FAULT", None)
    if fault is not None:
        env["PPDSL_FAULT"] = fault
    proc = subprocess.run(
        [sys.executable, "-m", "ppdsl", "run", schedule, "-D", "d=2", "-D", "m=4",
         "--model", model, "--steps", str(STEPS), "--optimizer", "adamw",
         "--weight-decay", "0.1", "--lr-schedule", "warmup-cosine", "--warmup-steps", "1",
         "--clip-grad-norm", "0.5", "--optimizer-validation", "post",
         "--checkpoint-dir", str(tmp / name), "--checkpoint-every", "1", "--keep-checkpoints", "2",
         "--json", str(tmp / f"{name}.json"), "--timeout", "30", *extra],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
    )
    return proc, tmp / name


def _checkpoint_tensors(path: Path) -> dict[str, object]:
    """Everything a checkpoint holds (weights, optimizer state, each process's
    record), read back through torch's own converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = path.parent.parent / f"{path.parent.name}-{path.name}.pt"
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)


def _same(a: object, b: object) -> bool:
    if isinstance(a, bytes):  # a process's record: pickled, compared by what it holds
        return isinstance(b, bytes) and _same(pickle.loads(a), pickle.loads(b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    tmp = tmp_path_factory.mktemp("whole")
    proc, ckpt = _run(tmp, "whole")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the clipping is live: a step whose rolled-back update a resume must not replay
    optimizer_steps = json.loads((tmp / "whole.json" / "rank0.json").read_text())["optimizer_steps"]
    assert any(step["clipped"] for step in optimizer_steps), optimizer_steps
    return proc.stdout, ckpt


# One job killed at the five points in turn, one per torchrun attempt
# (PPDSL_FAULT's list, runtime/worker/faults.py): in a forward, mid-exchange, in the
# optimizer step and during a save, each in step 3 (so each restart resumes from
# a checkpoint of step 2 at the latest: a background save of step 2 may still be
# unfinished), then right after step 3's save was made visible (the last restart
# resumes from it). One job instead of five saves four torchrun start-ups.
FAULTS = ("forward:3:1", "exchange:3:0", "optimizer:3:1", "save:3:1", "saved:3:0")


@pytest.mark.slow
@pytest.mark.distributed
def test_killed_rank_restarts_and_ends_bit_identical(
    tmp_path: Path, uninterrupted: tuple[str, Path]
) -> None:
    """A rank SIGKILLed in a forward, mid-exchange, in the optimizer step, during a
    save and right after one (one point per attempt, --max-restarts 5): each
    restart resumes from the newest complete checkpoint (never a partial save),
    and the job ends with parameters, optimizer state (AdamW with weight decay,
    post-validated clipping), LR schedule and RNGs (dropout) bit-identical to an
    uninterrupted run; every printed step's loss equals the
    uninterrupted one, and each attempt trains exactly the steps after its
    checkpoint, each once."""
    whole_out, whole_ckpt = uninterrupted
    proc, ckpt = _run(tmp_path, "killed", "--max-restarts", str(len(FAULTS)),
                      fault=",".join(FAULTS))
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    for k in range(1, len(FAULTS) + 1):
        assert f"restart {k} of at most {len(FAULTS)}" in proc.stdout, text
    assert proc.stderr.count("killed by SIGKILL") == len(FAULTS), text
    resumed = [int(s) for s in re.findall(r"resumed from \S+ \(after step (\d+)\)", proc.stdout)]
    assert len(resumed) == len(FAULTS) and max(resumed[:-1]) <= 2 and resumed[-1] == 3, text
    # every step printed, each time with the uninterrupted run's loss
    expected = dict(_STEP_LINE.findall(whole_out))
    printed = _STEP_LINE.findall(proc.stdout)
    assert {s for s, _ in printed} == set(expected), printed
    assert all(loss == expected[s] for s, loss in printed), (printed, expected)
    # each restarted attempt built the batches of the steps after its checkpoint,
    # once each, up to its kill (the last one to the end)
    for rank in (0, 1):
        calls = (tmp_path / f"killed.batches.{rank}").read_text().split("\n")
        for attempt, restart_from in enumerate(resumed, start=1):
            again = [int(line.split()[1]) for line in calls if line.startswith(f"{attempt} ")]
            assert again and again == list(range(restart_from, restart_from + len(again))), (
                rank, attempt, calls)
        assert again == list(range(resumed[-1], STEPS)), (rank, calls)
    # the newest two kept (--keep-checkpoints 2), nothing partial left; the same final
    # checkpoint, byte for byte in every tensor and record
    assert sorted(p.name for p in ckpt.iterdir()) == [f"step-{STEPS - 1:08d}", f"step-{STEPS:08d}"]
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(p.name for p in whole_ckpt.iterdir())
    final = f"step-{STEPS:08d}"
    assert _same(_checkpoint_tensors(whole_ckpt / final), _checkpoint_tensors(ckpt / final))
    whole = [json.loads((whole_ckpt.parent / "whole.json" / f"rank{r}.json").read_text())
             for r in (0, 1)]
    mine = [json.loads((tmp_path / "killed.json" / f"rank{r}.json").read_text()) for r in (0, 1)]
    for a, b in zip(whole, mine, strict=True):
        assert a["parameters_sha256"] == b["parameters_sha256"]
        assert {k: v for k, v in a["losses"].items() if int(k) > resumed[-1]} == b["losses"]


@pytest.mark.slow
@pytest.mark.distributed
def test_checkpoint_of_another_model_is_refused(
    tmp_path: Path, uninterrupted: tuple[str, Path]
) -> None:
    """Resuming from a checkpoint that another model saved stops at start-up (exit
    1, no traceback) with a message naming each difference, though the
    schedule, placement and world size changed too (those alone are resharded,
    docs/runtime.md "Checkpoints"); the same set-up resumes from it (a copy of
    the uninterrupted run's checkpoints: ZB-H1, the logged tiny_gpt, 2 ranks)."""
    import shutil

    shutil.copytree(uninterrupted[1], tmp_path / "ckpt")
    # one run that differs in every way: the model's differences are named, one a line
    proc, _ = _run(tmp_path, "ckpt", "--steps", str(STEPS + 2), "--dp", "2",
                   schedule="examples/interleaved_1f1b.pp", model=f"{TINY}:stages_long")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "cannot resume from" in proc.stderr and "its model differs" in proc.stderr
    for message in (
        f"  - architecture: '{LOGGED}' in the checkpoint, '{TINY}:stages_long' in this run\n",
        "  - tensor 'stage0.0.positions.weight' is [16, 32] in the checkpoint, [128, 32] in "
        "this run\n",
    ):
        assert message in proc.stderr, (message, proc.stderr)
    assert "schedule" not in proc.stderr and "world size" not in proc.stderr, proc.stderr
    again, _ = _run(tmp_path, "ckpt", "--steps", str(STEPS + 1))
    assert again.returncode == 0 and f"(after step {STEPS})" in again.stdout, (
        again.stdout + again.stderr)
    assert "resharded" not in again.stdout, again.stdout


def _identity(**changes: object) -> dict:
    """A run's identity (`run_identity`'s form): 2 stages on 2 ranks, `changes` applied."""
    base: dict = {"format": 2, "schedule": "zb_h1", "schedule_file": "zb_h1.pp",
                  "fingerprint": "a" * 64, "placement": [0, 1], "pipeline_ranks": 2,
                  "world_size": 4, "dp": 2, "dp_mode": "replicate", "cut": None,
                  "model": "m.py:f", "architecture": "m.py:f",
                  "stages": {"0": {"rank": 0, "model_stage": 0, "names": ["stage0.w"]},
                             "1": {"rank": 1, "model_stage": 1, "names": ["stage1.w"]}},
                  "tensors": {"stage0.w": [2, 2], "stage1.w": [2]}}
    base.update(changes)
    return base


def test_identity_differences_are_the_models_and_resharding_the_layouts() -> None:
    """Another --dp-mode, -D values or stage placement are no difference the model
    cannot survive, and `resharding` names the layout change and counts the
    tensors that changed ranks; another architecture, a missing tensor and
    another shape are each named; an identity of the earlier format is refused."""
    from ppdsl.runtime.training.checkpoint import identity_differences, resharding

    base = _identity()
    assert identity_differences(base, dict(base)) == [] and resharding(base, dict(base)) is None
    assert resharding(base, _identity(fingerprint="b" * 64)) is None
    moved = _identity(dp_mode="shard", schedule="one_f_one_b", stages={
        "0": {"rank": 0, "model_stage": 0, "names": ["stage0.w"]},
        "1": {"rank": 0, "model_stage": 1, "names": ["stage1.w"]}})
    assert identity_differences(base, moved) == []
    assert resharding(base, moved) == ("resharded from d=2 zb_h1 x 2 replicate replicas to "
                                       "d=2 one_f_one_b x 2 shard replicas: 1 tensor moved")
    other = _identity(architecture="n.py:g", tensors={"stage0.w": [3, 2], "stage2.w": [1]})
    assert identity_differences(base, other) == [
        "architecture: 'm.py:f' in the checkpoint, 'n.py:g' in this run",
        "tensor 'stage1.w' is in the checkpoint, not in this run's model",
        "tensor 'stage2.w' of this run's model is not in the checkpoint",
        "tensor 'stage0.w' is [2, 2] in the checkpoint, [3, 2] in this run",
    ]
    old = {k: v for k, v in base.items() if k != "format"}
    assert "written by an earlier ppdsl" in identity_differences(old, base)[0]


def test_partial_and_old_checkpoints() -> None:
    """A directory still named .partial-* (a save interrupted) or without torch's
    .metadata is never the newest checkpoint."""
    import tempfile

    from ppdsl.runtime.training.checkpoint import latest_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, complete in (("step-00000002", True), (".partial-step-00000003", True),
                               ("step-00000004", False)):
            (root / name).mkdir()
            if complete:
                (root / name / ".metadata").write_bytes(b"")
        assert latest_checkpoint(root) == root / "step-00000002"


@pytest.mark.distributed
def test_live_but_wedged_rank_is_reported_where_it_stands(tmp_path: Path) -> None:
    """A rank whose forward never returns while its process (and heartbeat) lives:
    within --timeout every rank stops (exit 1, no traceback), the first to see it
    printing where each rank stood: the wedged one computing its forward, the
    other waiting to receive its gradient."""
    import time

    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "ppdsl", "run", "examples/1f1b.pp", "-D", "d=2", "-D", "m=4",
         "--model", str(ROOT / "tests" / "dist" / "restart_model.py") + ":wedged",
         "--steps", "3", "--timeout", "5"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = proc.stderr
    assert "no rank made progress for 5 s, though every one is alive" in err, err
    assert re.search(r"^  rank 1: computing F\(mb \d, stage 1\)$", err, re.M), err
    assert re.search(r"^  rank 0: waiting to receive grad\(mb \d, stage 1->0, rank 1->0\)$",
                     err, re.M), err
    assert "Traceback" not in err, err
    assert elapsed < 60, elapsed

"""A run's start-up (ppdsl/runtime/training/startup.py) on a one-rank gloo group
in this process: a batch that does not split, a model without evaluation data
and a checkpoint required but absent each stop the run with one message and
exit 1; a good start says what runs and hands the loop its record."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from ppdsl.runtime.execution.pipeline import load_schedule
from ppdsl.runtime.training.startup import Run, start
from ppdsl.runtime.training.train import parse_options
from ppdsl.runtime.worker.bootstrap import EXIT_INVALID, Worker
from tests.paths import ROOT

TINY = str(ROOT / "examples" / "models" / "tiny_gpt.py")
EVALLESS = str(ROOT / "tests" / "dist" / "models.py")


def _start(*argv: str) -> Run | int:
    """`start` of rank 0 of 1F1B at d=1, m=2, with the options `argv`."""
    compiled = load_schedule(ROOT / "examples" / "1f1b.pp", {"d": 1, "m": 2})
    opts = parse_options(["--model", f"{TINY}:stages", *argv])
    opts.dp, opts.dp_mode = 1, "replicate"
    worker = Worker(0, 1, torch.device("cpu"), types.SimpleNamespace())  # type: ignore[arg-type]
    return start(compiled.plan, compiled.fingerprint, compiled.ops[0], opts, worker)


def test_a_good_start(one_rank, capsys: pytest.CaptureFixture[str]) -> None:
    """The opening line names the schedule, ranks, stages, microbatches, batch,
    device and optimizer; the record starts at step 0 and ends at `--steps`
    (or `--stop-after`, when sooner)."""
    run = _start("--steps", "5", "--batch-size", "4", "--optimizer", "sgd",
                 "--clip-grad-norm", "2")
    assert isinstance(run, Run)
    assert (run.first_step, run.last_step, run.batch_size, run.pp_rank) == (0, 5, 4, 0)
    assert run.runner.is_first and run.runner.is_last
    assert capsys.readouterr().out == (
        f"ppdsl: schedule one_f_one_b ({ROOT / 'examples' / '1f1b.pp'}): 1 ranks, 1 stages, 2 microbatches, "
        "batch 4, cpu (gloo), sgd, clip 2 (sync)\n")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch-size", "3"], "--batch-size 3 does not split into 2 microbatches; use a "
                                "multiple of 2"),
        (["--eval-every", "2"], "--eval-every needs evaluation data, but --model"),
    ],
    ids=["batch", "eval-data"],
)
def test_bad_model_or_batch_stops_the_run(
    one_rank, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    """Each problem is one `ppdsl: error:` line and exit 1, before any step."""
    if argv[0] == "--eval-every":  # a model with batches but no eval_batch
        argv = [*argv, "--model", f"{EVALLESS}:structured"]
    assert _start(*argv) == EXIT_INVALID
    err = capsys.readouterr().err
    assert err.startswith(f"ppdsl: error: {message}"), err


def test_checkpoints_resume_or_start_afresh(
    one_rank, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """An empty checkpoint folder starts at step 1 and says so; `--resume`
    without a checkpoint there is an error."""
    run = _start("--checkpoint-dir", str(tmp_path / "ck"), "--stop-after", "2")
    assert isinstance(run, Run) and (run.first_step, run.last_step) == (0, 2)
    assert run.checkpointer is not None
    run.checkpointer.wait()
    out = capsys.readouterr().out
    assert out.startswith(f"ppdsl: no checkpoint in {tmp_path / 'ck'} yet: starting at step 1\n")
    assert _start("--checkpoint-dir", str(tmp_path / "none"), "--resume") == EXIT_INVALID
    assert capsys.readouterr().err.startswith("ppdsl: error: ")

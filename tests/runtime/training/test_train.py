"""`ppdsl run` and the generated programs as a user runs them (real torchrun or
rank processes on gloo): the training options, data built only on the ranks
that use it, and throughput in the model's units."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ppdsl.cli import main
from tests.paths import ROOT

TINY = str(ROOT / "examples" / "models" / "tiny_gpt.py")
TEST_MODELS = str(ROOT / "tests" / "dist" / "models.py")


def _ppdsl(*args: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ppdsl", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--clip-grad-norm", "0"], "--clip-grad-norm must be positive"),
        (["--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint-dir"),
        (["--optimizer", "adam", "--momentum", "0.9"], "--momentum is SGD's"),
        (["--optimizer", "lion"], "invalid choice: 'lion'"),
        (["--precision", "fp8"], "invalid choice: 'fp8'"),
        (["--pack", "64"], "--pack is for documents: --data FILE.npz"),
        (["--reorder"], "--reorder is for documents: --data FILE.npz"),
    ],
    ids=["resume", "clip", "every", "momentum", "optimizer", "precision", "pack", "reorder"],
)
def test_training_options_usage_errors(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A training option out of its limits is a usage error (exit 2) saying what is
    wrong, before torchrun starts (in this process: `ppdsl run`'s usage errors as
    real processes, no traceback, are tests/system/test_robustness.py's)."""
    code = main(["run", str(ROOT / "examples" / "1f1b.pp"), "-D", "d=2", "--model",
                 f"{TINY}:stages", *args])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert message in err, err
    assert "Traceback" not in err


# A run stopped and resumed ends bit for bit where the uninterrupted run ends:
# tests/runtime/worker/test_faults.py (dropout RNG, AdamW with weight decay, warm-up +
# cosine, post-validated clipping, the data position; resumed after kills at five
# points) and tests/system/test_model_zoo.py::test_resume_restores_buffers
# (`--stop-after` then `--resume`, BatchNorm buffers, the validation loss).


@pytest.mark.slow
@pytest.mark.distributed
def test_data_built_only_where_used_and_throughput_units(tmp_path: Path) -> None:
    """At d=3 only the ranks holding the first or the last stage call batch(),
    once per step (rank 1 never); a model that does not say its inputs are tokens
    gets samples/s and no tokens/s; the options reach the ranks (SGD with
    momentum, warm-up + cosine, clipping, bf16) and the run trains."""
    log = tmp_path / "batch"
    env = dict(os.environ, PPDSL_TEST_BATCH_LOG=str(log), OMP_NUM_THREADS="1")
    proc = _ppdsl("run", "examples/1f1b.pp", "-D", "d=3", "--model", f"{TEST_MODELS}:counted",
                  "--steps", "3", "--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.01",
                  "--lr-schedule", "warmup-cosine", "--warmup-steps", "1", "--clip-grad-norm", "1",
                  "--precision", "bf16", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = {r: (Path(f"{log}.{r}").read_text().split() if Path(f"{log}.{r}").exists() else [])
             for r in range(3)}
    assert calls == {0: ["0", "1", "2"], 1: [], 2: ["0", "1", "2"]}, calls
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and all("samples/s" in s and "tokens/s" not in s for s in steps), steps
    assert "sgd, bf16, clip 1 (sync)" in proc.stdout
    assert "optimizer: 3 steps" in proc.stdout


# The watchdog's clean exit (its heartbeat thread joined before the process
# group goes) is tests/runtime/worker/test_watchdog.py's.


# examples/train_loop.py under torchrun (2 ranks: the loss falls, the checkpoint is
# written) is the README's own command line, run and checked by
# tests/system/test_readme.py.

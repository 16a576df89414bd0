"""Checkpoints on real files (ppdsl/runtime/training/checkpoint.py, docs/runtime.md
"Checkpoints"): a save becomes visible only by its rename, interrupted saves are
never resumed and are cleared, the newest K are kept, a resume restores the
state bit for bit and refuses a checkpoint of another run set-up; one process
(a one-rank gloo group) and a real PipelineRunner."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from ppdsl.runtime.execution.pipeline import PipelineRunner, load_schedule
from ppdsl.runtime.training.checkpoint import (
    IDENTITY_FILE,
    Checkpointer,
    CheckpointError,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    run_identity,
    save_checkpoint,
)
from tests.paths import ROOT


def _runner(width: int = 4) -> tuple[PipelineRunner, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    schedule = load_schedule(ROOT / "examples" / "1f1b.pp", {"d": 1, "m": 2})
    runner = PipelineRunner(schedule, {0: nn.Linear(4, width)},
                            lambda out, y: ((out - y) ** 2).mean())
    optimizer = torch.optim.Adam(runner.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return runner, optimizer, scheduler


def _train(runner: PipelineRunner, optimizer: torch.optim.Optimizer, scheduler) -> None:
    optimizer.zero_grad()
    runner.step(torch.randn(4, 4), torch.randn(4, 4))
    optimizer.step()
    scheduler.step()


def _identity(runner: PipelineRunner, model: str = "tests:linear") -> dict:
    return run_identity(runner.plan, runner, model=model, world_size=1, dp=1, dp_mode="replicate")


def test_saves_appear_by_rename_and_the_newest_k_are_kept(one_rank, tmp_path: Path) -> None:
    """A background save appears as `step-N` (with the run's identity beside it)
    only once finished, nothing `.partial-` is left; of three saves with keep=2
    the newest two stay."""
    runner, optimizer, scheduler = _runner()
    events: list[tuple[str, int]] = []
    saver = Checkpointer(tmp_path, runner, optimizer, scheduler=scheduler,
                         identity=_identity(runner), keep=2,
                         on_event=lambda name, step: events.append((name, step)))
    for step in (1, 2, 3):
        _train(runner, optimizer, scheduler)
        saver.save(step)
        final = checkpoint_path(tmp_path, step)
        assert not final.exists()  # written in the background, not yet made visible
        assert latest_checkpoint(tmp_path) == (checkpoint_path(tmp_path, step - 1)
                                               if step > 1 else None)
        saver.wait()
        assert (final / ".metadata").is_file() and (final / IDENTITY_FILE).is_file()
        assert latest_checkpoint(tmp_path) == final
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000003"]
    assert events == [("save", 1), ("saved", 1), ("save", 2), ("saved", 2), ("save", 3),
                      ("saved", 3)]


def test_resume_restores_the_newest_complete_and_clears_partial_ones(one_rank, tmp_path: Path) -> None:
    """An interrupted save (a `.partial-` folder, even with its `.metadata` written)
    is never the latest and is removed at resume; the resumed weights, Adam state,
    scheduler and RNG are those of the newest complete save, bit for bit."""
    runner, optimizer, scheduler = _runner()
    saver = Checkpointer(tmp_path, runner, optimizer, scheduler=scheduler, asynchronous=False)
    for step in (1, 2):
        _train(runner, optimizer, scheduler)
        saver.save(step)
    saved = [p.detach().clone() for p in runner.parameters()]
    saved_moment = optimizer.state[runner.parameters()[0]]["exp_avg"].clone()
    after_save = torch.rand(3)  # what the RNG draws next, as saved
    killed = tmp_path / ".partial-step-00000009"
    killed.mkdir()
    (killed / ".metadata").write_text("a save killed before its rename")
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 2)

    other, other_optimizer, other_scheduler = _runner()
    _train(other, other_optimizer, other_scheduler)  # moved on: a resume must undo it
    resumer = Checkpointer(tmp_path, other, other_optimizer, scheduler=other_scheduler)
    assert resumer.resume() == (2, checkpoint_path(tmp_path, 2))
    assert not killed.exists()
    for p, q in zip(other.parameters(), saved, strict=True):
        assert torch.equal(p, q)
    assert torch.equal(other_optimizer.state[other.parameters()[0]]["exp_avg"], saved_moment)
    assert other_scheduler.last_epoch == 2
    assert torch.equal(torch.rand(3), after_save)


def test_the_same_step_saved_again_replaces_the_old(one_rank, tmp_path: Path) -> None:
    """A step saved twice (a restarted run reaching it again) holds the second save."""
    runner, optimizer, scheduler = _runner()
    path = checkpoint_path(tmp_path, 1)
    save_checkpoint(path, runner, optimizer, step=1)
    _train(runner, optimizer, scheduler)
    save_checkpoint(path, runner, optimizer, step=1, extra="second")
    second = [p.detach().clone() for p in runner.parameters()]
    _train(runner, optimizer, scheduler)
    assert load_checkpoint(path, runner, optimizer) == {"step": 1, "extra": "second"}
    for p, q in zip(runner.parameters(), second, strict=True):
        assert torch.equal(p, q)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]


def test_resume_refuses_a_checkpoint_of_another_model(one_rank, tmp_path: Path) -> None:
    """A checkpoint saved by another model (factory, a parameter's shape) is
    refused at resume, naming each difference and what to do; a layout change
    alone is not a difference (docs/runtime.md, "Checkpoints")."""
    runner, optimizer, scheduler = _runner()
    saver = Checkpointer(tmp_path, runner, optimizer, identity=_identity(runner),
                         asynchronous=False)
    saver.save(1)
    other, other_optimizer, _ = _runner(width=5)
    resumer = Checkpointer(tmp_path, other, other_optimizer,
                           identity=_identity(other, model="tests:wider"))
    with pytest.raises(CheckpointError) as refused:
        resumer.resume()
    text = str(refused.value)
    assert "its model differs from this run's" in text
    assert "architecture: 'tests:linear' in the checkpoint, 'tests:wider' in this run" in text
    assert "tensor 'stage0.bias' is [4] in the checkpoint, [5] in this run" in text
    assert "tensor 'stage0.weight' is [4, 4] in the checkpoint, [5, 4] in this run" in text
    assert "give another --checkpoint-dir to start afresh" in text
    with pytest.raises(CheckpointError, match="--resume: no complete checkpoint"):
        Checkpointer(tmp_path / "empty", runner, optimizer).resume(require=True)
    # without its ppdsl.json the shapes are still checked, against torch's metadata
    with pytest.raises(CheckpointError, match=r"stage0.bias is \[4\] in the checkpoint, \[5\]"):
        load_checkpoint(checkpoint_path(tmp_path, 1), other, other_optimizer)


def test_a_checkpoint_of_the_earlier_format_is_refused(one_rank, tmp_path: Path) -> None:
    """A checkpoint keyed by stage (what ppdsl wrote before checkpoints were keyed
    by the model's names: `process{rank}` records, an identity without a
    format) is refused with a message saying so, at resume and at load."""
    import torch.distributed.checkpoint as dcp

    runner, optimizer, _ = _runner()
    old = checkpoint_path(tmp_path, 1)
    dcp.save({"model": {"stage0.weight": runner.parameters()[0].detach()},
              "process0": b"old"}, checkpoint_id=str(old))
    (old / IDENTITY_FILE).write_text('{"schedule": "one_f_one_b"}')
    with pytest.raises(CheckpointError, match="written by an earlier ppdsl, which keyed "
                                              "checkpoints by stage"):
        Checkpointer(tmp_path, runner, optimizer, identity=_identity(runner)).resume()
    with pytest.raises(CheckpointError, match="written by an earlier ppdsl"):
        load_checkpoint(old, runner, optimizer)

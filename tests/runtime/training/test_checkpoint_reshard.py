"""Resuming under another layout (ppdsl/runtime/training/checkpoint.py,
docs/runtime.md "Checkpoints"): a checkpoint keyed by the model's own names,
saved at d=4 under 1F1B, loads at d=2 under ZB-V and at d=4 under another cut,
and the next 2 steps equal an uninterrupted d=2 run from the same weights; under
`ppdsl run` the start-up line says what was resharded, `ppdsl.json` records the
old layout, and a model the checkpoint does not fit is refused, each
difference named."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist import harness, hf_models
from tests.paths import ROOT

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

SEQ, BATCH, M, LAYERS = 8, 8, 4, 6
OTHER_CUT = "0,1,3,5"  # the equal cut of 6 layers into 4 stages is 0,2,4,5


def _load(out: Path, optimizer: str, case: str, ranks: range,
          what: str = "tensors") -> tuple[list[float], dict]:
    """The losses one case saw and its tensors and optimizer state (after the
    last step, or with `what="loaded"` right after the resume), merged over `ranks`."""
    losses: list[float] = []
    tensors: dict = {}
    for r in ranks:
        found = torch.load(out / f"{optimizer}-{case}.rank{r}.pt")
        losses += found["losses"]
        tensors.update(found[what])
    return losses, tensors


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / (float(b.abs().max()) or 1.0)


@pytest.mark.slow
@pytest.mark.distributed
def test_resumed_under_another_layout_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    """Qwen2 (tied head), 6 layers: for SGD with momentum and for Adam, 2 steps at
    d=4 1F1B then a checkpoint; loaded at d=2 under ZB-V (its V placement puts
    the embedding and the tied head on one rank) and at d=4 under the cut
    0,1,3,5, every tensor and optimizer state is the saved one bit for bit; the
    losses of steps 3 and 4 equal an uninterrupted d=2 1F1B run's from the same
    initial weights within 1e-5 relative (fp32), and so does every tensor after
    step 4 under SGD; under Adam within 1e-4 (Adam divides each update by the
    root of its second moment, so the two pipelines' fp32 summation orders show
    up larger there: 3.3e-5 measured). One launch of 4 ranks runs every case."""
    folder = hf_models.write(tmp_path, "qwen2", layers=LAYERS)
    specs = [{"id": name, "optimizer": name, "dir": str(folder), "m": M, "seq_len": SEQ,
              "batch": BATCH, "other_cut": OTHER_CUT,
              "checkpoint": str(tmp_path / "ck" / name / "step-00000002")}
             for name in ("sgd", "adam")]
    out = tmp_path / "out"
    found = harness.run_cases(specs, 4, out, timeout=900, worker="reshard_worker.py")
    for spec in specs:
        for r in found[spec["id"]]:
            assert "error" not in r, (spec["id"], r.get("error"), r.get("traceback"))
        name = spec["optimizer"]
        want_losses, want = _load(out, name, "reference", range(2, 4))
        assert len(want_losses) == 4
        _, saved = _load(out, name, "saved", range(4))
        assert any("/" in n for n in saved), name  # the optimizer's state is in it
        tolerance = 1e-5 if name == "sgd" else 1e-4
        for case, ranks in (("zbv", range(2)), ("cut", range(4))):
            _, loaded = _load(out, name, case, ranks, "loaded")
            assert set(loaded) == set(saved), (name, case, set(saved) ^ set(loaded))
            for n, value in saved.items():
                assert torch.equal(loaded[n], value), (name, case, n)
            losses, tensors = _load(out, name, case, ranks)
            assert len(losses) == 2, (name, case, losses)
            for got, expected in zip(losses, want_losses[2:], strict=True):
                assert abs(got - expected) <= 1e-5 * abs(expected), (name, case, losses,
                                                                      want_losses)
            assert set(tensors) == set(want), (name, case)
            worst = max(_relative(tensors[n], want[n]) for n in want if "/" not in n)
            assert worst <= tolerance, (name, case, worst)
        # the checkpoint moved the weights on: resumed runs are not the initial model's
        saved_losses, _ = _load(out, name, "saved", range(4))
        assert saved_losses == pytest.approx(want_losses[:2], rel=1e-5)


def _ppdsl_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ppdsl", "run", *args], capture_output=True,
                          text=True, timeout=900, cwd=ROOT)


@pytest.mark.slow
@pytest.mark.distributed
def test_ppdsl_run_reshards_and_refuses_another_model(tmp_path: Path) -> None:
    """`ppdsl run` at d=2 under 1F1B stops after step 2 with a checkpoint whose
    `ppdsl.json` records the layout (stages -> ranks -> names, d, schedule, cut);
    the same command under ZB-V (4 stages in a V on the 2 ranks) resumes it,
    saying "resharded from d=2 one_f_one_b cut 0,3 to d=2 zb_v cut 0,2,4,5: N
    tensors moved", and trains to step 4 (2 ranks keep it cheap: the d=4 path
    is the test above's). A wider model of the same architecture resumed from it is
    refused before training (exit 1, no traceback), each differing tensor named;
    a model of another architecture likewise."""
    folder = hf_models.write(tmp_path, "qwen2", layers=LAYERS)
    checkpoints = tmp_path / "ck"
    common = ["--model", f"hf:{folder}", "--seq-len", str(SEQ), "--batch-size", str(BATCH),
              "--steps", "4", "--checkpoint-dir", str(checkpoints), "--sync-checkpoints"]
    first = _ppdsl_run("examples/1f1b.pp", "-D", "d=2", "-D", f"m={M}", "--stop-after", "2",
                       *common)
    assert first.returncode == 0, first.stdout + first.stderr
    identity = json.loads((checkpoints / "step-00000002" / "ppdsl.json").read_text())
    assert (identity["pipeline_ranks"], identity["schedule"], identity["cut"]) == (
        2, "one_f_one_b", [0, 3])
    assert identity["stages"]["1"]["rank"] == 1
    assert "lm_head.weight" in identity["stages"]["1"]["names"]
    assert "model.layers.5.mlp.up_proj.weight" in identity["stages"]["1"]["names"]
    kept = tmp_path / "kept"
    shutil.copytree(checkpoints, kept)

    second = _ppdsl_run("examples/zb_v.pp", "-D", "d=2", "-D", f"m={M}", *common)
    assert second.returncode == 0, second.stdout + second.stderr
    line = next(x for x in second.stdout.splitlines() if "resumed from" in x)
    assert ("after step 2), resharded from d=2 one_f_one_b cut 0,3 to d=2 zb_v cut "
            "0,2,4,5:") in line, line
    moved = int(line.split(": ")[-1].split()[0])
    # ZB-V puts stages 0 and 3 on rank 0, 1 and 2 on rank 1: layers 2, 4 and 5
    # change ranks, and the head (tied to the embedding) and final norm join rank 0
    assert moved > 0, line
    assert "step    4/4" in second.stdout

    wider = tmp_path / "wider"
    cfg = hf_models.config("qwen2", LAYERS)
    cfg.intermediate_size = 96
    cfg.save_pretrained(wider)
    other = tmp_path / "llama"
    hf_models.config("llama", LAYERS).save_pretrained(other)
    for model, messages in (
            (wider, ["its model differs from this run's",
                     "tensor 'model.layers.0.mlp.up_proj.weight' is [64, 32] in the checkpoint, "
                     "[96, 32] in this run", "and "]),
            (other, ["architecture: 'qwen2' in the checkpoint, 'llama' in this run"])):
        refused = _ppdsl_run("examples/1f1b.pp", "-D", "d=2", "-D", f"m={M}", "--model",
                             f"hf:{model}", "--seq-len", str(SEQ), "--batch-size", str(BATCH),
                             "--steps", "4", "--checkpoint-dir", str(kept))
        assert refused.returncode == 1, refused.stdout + refused.stderr
        for message in messages:
            assert message in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr and "step " not in refused.stdout

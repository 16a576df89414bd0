"""Variable-length microbatches under real processes (issue 38, docs/runtime.md):
documents of a long-tailed length distribution trained by 1F1B and ZB-V at d=4,
m=8, every transfer at its microbatch's true shape, equal to the whole model
trained without a pipeline on the same documents. Every case runs in ONE process
group (tests/dist/varlen_worker.py), started once per session."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.dist import harness, hf_models

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

D, M, STEPS, LR, TOL = 4, 8, 3, 0.5, 1e-5
SCHEDULES = ("1f1b", "zb_v")
FAMILIES = ("llama", "gpt2")  # rotary positions; learned positions (a restart that fails shows)
RULES = {"cut": {"max_seq_len": 48}, "pack": {"pack": 64},
         "reorder": {"max_seq_len": 48, "reorder": True},
         "pack-reorder": {"pack": 64, "reorder": True}}


def long_tailed_documents(path: Path, count: int = 48, seed: int = 0) -> np.ndarray:
    """A document file whose lengths are 3 + 6 x Pareto(1.2), capped at 60 tokens
    (most short, a few long); its lengths."""
    rng = np.random.default_rng(seed)
    lengths = np.clip((rng.pareto(1.2, count) * 6 + 3).astype(np.int64), 3, 60)
    tokens = rng.integers(0, hf_models.VOCAB, int(lengths.sum()))
    np.savez(path, tokens=tokens, offsets=np.concatenate([[0], np.cumsum(lengths)[:-1]]))
    return lengths


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every case's per-rank results, from one launch of D ranks."""
    work = tmp_path_factory.mktemp("varlen")
    data = work / "docs.npz"
    long_tailed_documents(data)
    cases = []
    for family in FAMILIES:
        folder = hf_models.write(work, family, layers=8)  # ZB-V: 8 stages of one layer
        for schedule in SCHEDULES:
            for rule, given in RULES.items():
                cases.append({"id": f"{family}-{schedule}-{rule}", "schedule": schedule, "m": M,
                              "dir": str(folder), "data": str(data), "lr": LR, "steps": STEPS,
                              **given})
    return harness.run_cases(cases, D, work / "out", timeout=1500, worker="varlen_worker.py")


CASES = [f"{f}-{s}-{r}" for f in FAMILIES for s in SCHEDULES for r in RULES]


@pytest.mark.parametrize("case", CASES)
def test_documents_train_as_the_unpipelined_model(results: dict, case: str) -> None:
    """After 3 SGD steps the parameters equal the whole model's trained on the
    same documents, each alone (1e-5, fp32), and each step's loss is its loss:
    the mean over the step's target tokens."""
    ranks = results[case]
    for r in ranks:
        assert "error" not in r, (case, r.get("error"), r.get("traceback"))
    head = ranks[0]
    assert not head["missing"], head["missing"]
    assert head["moved"] > 100 * TOL  # the steps changed the weights
    assert head["max_param_diff"] <= TOL, (case, head["max_param_diff"])
    assert head["pipeline_losses"] == pytest.approx(head["reference_losses"], abs=TOL)


@pytest.mark.parametrize("case", [c for c in CASES if c.endswith("reorder")])
def test_reorder_permutes_every_step_alike(results: dict, case: str) -> None:
    """Under --reorder every rank runs the same permutation of each step's
    microbatches, and some step's is not the order given (its time per step is
    bench/results/varlen.md's)."""
    ranks = results[case]
    orders = [[order for order, _ in r["orders"]] for r in ranks]
    assert all(o == orders[0] for o in orders), orders
    assert all(sorted(o) == list(range(M)) for o in orders[0])
    assert any(o != list(range(M)) for o in orders[0]), orders[0]


@pytest.mark.parametrize("case", CASES)
def test_nothing_is_padded(results: dict, case: str) -> None:
    """The bytes every rank sent equal the sum of the microbatches' true sizes."""
    head = results[case][0]
    assert "error" not in head, head.get("error")
    assert head["sent_bytes"] == head["true_bytes"]


def test_an_unexpected_shape_stops_every_rank_naming_both(tmp_path: Path) -> None:
    """A stage whose output does not keep its microbatch's tokens stops the run:
    one message names the microbatch and both shapes, every rank exits 1 by
    itself (no rank waits for a tensor of another size: the harness's limit is
    only for a loaded machine's start-up), no traceback."""
    env = {"PPDSL_TEST_DOCS": str(tmp_path / "docs.npz")}
    out = tmp_path / "build"
    subprocess.run([sys.executable, "-m", "ppdsl", "compile", "examples/1f1b.pp", "-D", "d=2",
                    "-D", "m=4", "-o", str(out)], cwd=harness.ROOT, check=True,
                   capture_output=True)
    results = harness.run([str(out / "launch.py"), "--model",
                           f"{harness.ROOT / 'tests' / 'dist' / 'bad_models.py'}:varlen_drops_token",
                           "--steps", "2", "--timeout", "20"], 2, timeout=600, env=env)
    text = "\n".join(r.stdout + r.stderr for r in results)
    assert all(r.returncode == 1 for r in results), text
    assert "microbatch 2: stage 0 made activation tensor 0 of shape [1, 4, 8]" in text, text
    assert "expects [1, 5, 8]" in text, text
    assert "Traceback" not in text, text

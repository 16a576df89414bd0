"""Training as people do it, under real processes and torch.distributed (gloo):
the library in a loop, clipping and inf/NaN skips with sync and post validation,
mixed precision, tied parameters, several tensors between stages, and the
compiled orders under torch.distributed.pipelining's runtime.

Every case at d=2 runs in ONE process group (tests/dist/train_worker.py, started
once by a module fixture) and is compared with a single-process run of the same
model on the same batches (1e-5 relative in fp32, as tests/system/test_pipeline_dist.py).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from tests.dist import harness

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5
D = 2
BRIDGE = ["1f1b", "zb_h1", "zb_v", "interleaved_1f1b", "gpipe", "zb_h2"]


def _pickle(work: Path, name: str) -> str:
    from ppdsl.compiler import compile_file

    path = work / f"{name}.pickle"
    if not path.exists():
        compiled = compile_file(ROOT / "examples" / f"{name}.pp", {"d": str(D)})
        path.write_bytes(pickle.dumps((compiled.schedule, compiled.programs)))
    return str(path)


def _cases(work: Path) -> list[dict]:
    from ppdsl.compiler import compile_file
    from ppdsl.interchange import to_torch_csv

    cases: list[dict] = []

    def add(case_id: str, kind: str, schedule: str, **extra) -> None:
        cases.append({"id": case_id, "kind": kind, "pickle": _pickle(work, schedule),
                      "model": "tiny:stages", "steps": 3, **extra})

    for name in BRIDGE:
        add(f"bridge-{name}", "bridge", name)
    csv = work / "zb_h1.csv"
    csv.write_text(to_torch_csv(compile_file(ROOT / "examples" / "zb_h1.pp", {"d": str(D)}).schedule))
    add("bridge-csv-zb_h1", "bridge", "zb_h1", csv=str(csv))
    for validation in ("sync", "post"):
        for name in ("zb_h1", "zb_v"):
            add(f"clip-{validation}-{name}", "train", name, validation=validation, max_norm=0.5)
        # a NaN in stage 1's gradients (rank 1) at step 2 of 3
        add(f"nan-{validation}-zb_h1", "train", "zb_h1", validation=validation,
            poison_steps=[1], poison_stage=1, poison=float("nan"))
        # Adam's state rolled back, clipping active too, the NaN on rank 0's stage 3
        add(f"nan-clip-adam-{validation}-zb_v", "train", "zb_v", validation=validation,
            optimizer="adam", max_norm=0.5, poison_steps=[1], poison_stage=3,
            poison=float("nan"), steps=4)
        # fp16: an inf in stage 0's (rank 0's) gradients at step 2: both ranks skip
        add(f"fp16-{validation}-zb_h1", "train", "zb_h1", validation=validation,
            precision="fp16", poison_steps=[1], poison_stage=0, poison=float("inf"), steps=4)
    add("bf16-zb_h1", "train", "zb_h1", precision="bf16")
    for name in ("1f1b", "zb_h1", "zb_v"):
        add(f"tied-{name}", "train", name, model="tiny:stages_tied", validation="post",
            max_norm=0.5)
        add(f"structured-{name}", "train", name, model="test:structured")
    # the NCCL-style ordered transport and the shared-GPU staged one, on CPU tensors
    for transfer in ("ordered", "staged"):
        for name in ("zb_h1", "zb_v"):
            add(f"{transfer}-{name}", "train", name, transfer=transfer)
        add(f"{transfer}-tied-rendezvous-zb_h1", "train", "zb_h1", model="tiny:stages_tied",
            transfer=transfer, standin="rendezvous")
    add("ordered-delayed-1f1b", "train", "1f1b", transfer="ordered", standin="delayed")
    return cases


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("training")
    return harness.run_cases(_cases(work), D, work, worker="train_worker.py")


def _case(results: dict, case_id: str) -> list[dict]:
    per_rank = results[case_id]
    errors = [r["error"] + "\n" + r.get("traceback", "") for r in per_rank if "error" in r]
    assert not errors, errors[0]
    return per_rank


@pytest.mark.parametrize("name", BRIDGE + ["csv-zb_h1"])
def test_compiled_orders_under_torch_runtime(results: dict, name: str) -> None:
    """The compiled per-rank orders, run by torch.distributed.pipelining's
    `_PipelineScheduleRuntime` (from the action lists, or from the exported CSV
    through torch's `_load_csv`), give the loss and every gradient of a
    single-process run within 1e-5."""
    per_rank = _case(results, f"bridge-{name}")
    assert {r["class"] for r in per_rank} == {"_PipelineScheduleRuntime"}
    for r in per_rank:
        assert r["grad_rel_err"] <= TOL, r
        if "loss_rel_err" in r:
            assert r["loss_rel_err"] <= TOL, r


def _fp32_equal(per_rank: list[dict]) -> None:
    for r in per_rank:
        assert r["loss_rel_err"] <= TOL and r["grad_rel_err"] <= TOL, r
        assert r["param_rel_err"] <= TOL, r


@pytest.mark.parametrize("validation", ["sync", "post"])
@pytest.mark.parametrize("name", ["zb_h1", "zb_v"])
def test_clipping_by_global_norm(results: dict, validation: str, name: str) -> None:
    """--clip-grad-norm with sync and post validation: the parameters after three
    SGD (momentum) steps equal a single-process run clipping by the same global
    norm (torch.nn.utils.clip_grad_norm_); every step was clipped (post: rolled
    back and redone), with the reference's norm."""
    per_rank = _case(results, f"clip-{validation}-{name}")
    _fp32_equal(per_rank)
    for r in per_rank:
        assert all(o["clipped"] and not o["skipped"] for o in r["outcomes"]), r["outcomes"]
        assert all(o["rolled_back"] == (validation == "post") for o in r["outcomes"])
        for o, ref in zip(r["outcomes"], r["ref_norms"], strict=True):
            assert abs(o["grad_norm"] - ref) <= TOL * ref


@pytest.mark.parametrize("validation", ["sync", "post"])
def test_nan_in_one_rank_skips_the_step_everywhere(results: dict, validation: str) -> None:
    """A NaN injected into rank 1's gradients at step 2: every rank skips that
    step (post: rank 1 never stepped, rank 0 rolled back), leaving every
    parameter bit for bit as it was; the parameters after three steps equal a
    single-process run that skipped step 2."""
    per_rank = _case(results, f"nan-{validation}-zb_h1")
    _fp32_equal(per_rank)
    for r in per_rank:
        assert [o["skipped"] for o in r["outcomes"]] == [False, True, False], r["outcomes"]
        assert r["unchanged_at_skips"] == [True], r
    rolled = {r["rank"]: r["outcomes"][1]["rolled_back"] for r in per_rank}
    assert rolled == ({0: True, 1: False} if validation == "post" else {0: False, 1: False})


@pytest.mark.parametrize("validation", ["sync", "post"])
def test_nan_with_clipping_and_adam(results: dict, validation: str) -> None:
    """ZB-V (rank 0 holds stages 0 and 3), Adam, clipping active, a NaN in stage 3
    at step 2 of 4: Adam's moments and step count are restored with the
    parameters on rollback, and the result equals a single-process run that
    clips by the global norm and skips step 2."""
    per_rank = _case(results, f"nan-clip-adam-{validation}-zb_v")
    _fp32_equal(per_rank)
    for r in per_rank:
        assert [o["skipped"] for o in r["outcomes"]] == [False, True, False, False]
        assert r["unchanged_at_skips"] == [True]


@pytest.mark.parametrize("validation", ["sync", "post"])
def test_fp16_loss_scale_one_decision(results: dict, validation: str) -> None:
    """fp16 autocast with loss scaling: an inf in rank 0's gradients at step 2
    makes both ranks skip it (rank 1's own gradients were finite), both halve the
    scale (65536 -> 32768, as torch.amp.GradScaler does in the single-process
    run); training otherwise follows the single-process fp16 run (1e-2: fp16
    rounding differs between a batch and its microbatches)."""
    per_rank = _case(results, f"fp16-{validation}-zb_h1")
    for r in per_rank:
        assert [o["skipped"] for o in r["outcomes"]] == [False, True, False, False]
        assert r["unchanged_at_skips"] == [True]
        assert r["scales"] == [65536.0, 32768.0, 32768.0, 32768.0]
        assert r["scales"][-1] == r["ref_scale"]
        assert r["param_rel_err"] <= 1e-2 and r["grad_rel_err"] <= 1e-2, r


def test_bf16_autocast(results: dict) -> None:
    """bf16 autocast: loss and gradients follow the single-process bf16 run (2e-2:
    bf16 keeps 8 bits of mantissa; fp32 would be 1e-5)."""
    for r in _case(results, "bf16-zb_h1"):
        assert r["loss_rel_err"] <= 2e-2 and r["grad_rel_err"] <= 2e-2, r
        assert r["param_rel_err"] <= 2e-2, r


@pytest.mark.parametrize("name", ["1f1b", "zb_h1", "zb_v"])
def test_tied_parameters(results: dict, name: str) -> None:
    """tiny_gpt with the head tied to the token embedding (one parameter in the
    single-process run): on two ranks (1F1B, ZB-H1) the gradients are summed over
    both owners, on one rank (ZB-V holds stages 0 and 3) the two are one
    Parameter; with post-validated clipping, loss, gradients and parameters equal
    the single-process run, and every owner holds the same bits."""
    per_rank = _case(results, f"tied-{name}")
    _fp32_equal(per_rank)
    for r in per_rank:
        if "tied_bitwise_equal" in r:
            assert r["tied_bitwise_equal"], r


@pytest.mark.parametrize("name", ["1f1b", "zb_h1", "zb_v"])
def test_tensors_between_stages(results: dict, name: str) -> None:
    """Stages taking (ids, mask) and passing dicts of hidden states, a boolean mask
    and a gate only the last stage uses (it passes through ZB-V's middle stages):
    loss, gradients and parameters equal the single-process run."""
    _fp32_equal(_case(results, f"structured-{name}"))


@pytest.mark.parametrize("transfer", ["ordered", "staged"])
@pytest.mark.parametrize("name", ["zb_h1", "zb_v"])
def test_transports_train_as_single_process(results: dict, transfer: str, name: str) -> None:
    """The NCCL-style ordered transport (one batch per exchange) and the shared-GPU
    staged one (host copies over gloo, docs/runtime.md), both forced on CPU
    tensors: loss, gradients and parameters equal the single-process run."""
    _fp32_equal(_case(results, f"{transfer}-{name}"))


@pytest.mark.parametrize("transfer", ["ordered", "staged"])
def test_tied_gradient_sync_survives_blocking_sends(results: dict, transfer: str) -> None:
    """With sends that block until the peer's receive is posted (NCCL for a tensor
    past its buffering), the tied embedding's gradient sync does not deadlock (its
    sends and receives are posted as one batch, receives first) and training
    equals the single-process run."""
    per_rank = _case(results, f"{transfer}-tied-rendezvous-zb_h1")
    _fp32_equal(per_rank)
    assert all(r["tied_bitwise_equal"] for r in per_rank if "tied_bitwise_equal" in r)


def test_no_exchange_waits_on_its_sends(results: dict) -> None:
    """Under the ordered (NCCL) transport with sends whose completion is delayed,
    no send is waited for before its rank's passes of the step have ended: a
    send completes lazily (docs/runtime.md), it never stalls the passes after it."""
    per_rank = _case(results, "ordered-delayed-1f1b")
    _fp32_equal(per_rank)
    for r in per_rank:
        assert r["send_waits"], r  # the stand-in saw the sends
        assert set(r["send_waits"]) <= set(r["step_ends"]), r

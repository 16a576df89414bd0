"""The runtime on ONE GPU (skipped without CUDA): the B/W split splits under
CUDA, whose autograd runs backward nodes on a device worker thread; what B keeps
for W is the meter's M_W; profile, trace and device choice work there; several
ranks share the GPU (`--share-gpu`, transfers staged through host memory), so
multi-rank runs execute on CUDA too. `make gpu-check` runs these and more."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import subprocess
import sys
import threading
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from torch import nn

from ppdsl.ir.schedule import PassKind
from ppdsl.runtime.execution import split
from ppdsl.runtime.execution.memory import MemoryMeter, storage_bytes
from ppdsl.runtime.execution.split import WStash, backward_input

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (one GPU)"),
]

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "models" / "tiny_gpt.py") + ":stages"
CUDA = torch.device("cuda", 0)


class _Block(nn.Module):
    """A pre-norm attention + MLP block at hidden 256 (big enough that CUDA runs it
    as it would a real model's)."""

    def __init__(self, hidden: int = 256, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(h, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, h // self.heads).transpose(1, 2) for z in (q, k, v))
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, h))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


def _stage() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(_Block(), _Block()).to(CUDA)


@pytest.mark.parametrize("norms", ["in-b", "deferred"])
def test_split_splits_on_cuda(norms: str) -> None:
    """On cuda:0: after B no weight has a gradient but, under norms="in-b", the layer
    norms' (B ran on autograd's device thread), W sets every one equal to a fused
    backward's, and what B keeps is the meter's M_W: the layer inputs in the
    stash, 0 < M_W < M_B."""
    stage, reference = _stage(), None
    reference = copy.deepcopy(stage)
    x = torch.randn(4, 128, 256, device=CUDA, requires_grad=True)
    grad_out = torch.randn(4, 128, 256, device=CUDA)
    meter = MemoryMeter(stage.parameters())
    with meter.saving((0, 0)):
        out = stage(x)
    meter.after(PassKind.F, (0, 0), Fraction(1))
    stash = WStash()
    dx = backward_input(out, grad_out, x, stash, norms=norms)
    del out
    torch.cuda.synchronize()
    after_b = {n for n, p in stage.named_parameters() if p.grad is not None}
    norm_params = {n for n, _ in stage.named_parameters() if ".norm" in n}
    assert len(norm_params) == 8 and after_b == (norm_params if norms == "in-b" else set())
    meter.set_stash((0, 0), stash.tensors, stash.gradients)
    meter.after(PassKind.B, (0, 0), Fraction(1))
    mw, mb = meter.after_b[(0, 0)], meter.f_bytes[(0, 0)]
    assert mw == storage_bytes(stash.tensors) and 0 < mw < mb
    stash.run()
    xr = x.detach().clone().requires_grad_(True)
    reference(xr).backward(grad_out)
    torch.testing.assert_close(dx, xr.grad, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(stage.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_bytes_held_between_b_and_w_are_m_w() -> None:
    """The CUDA allocator agrees: between B and W the stage holds the stash's layer
    inputs (M_W, by the meter) and output gradients, and W frees them."""
    stage = _stage()
    x = torch.randn(4, 128, 256, device=CUDA, requires_grad=True)
    grad_out = torch.randn(4, 128, 256, device=CUDA)
    for p in stage.parameters():  # the gradients' own memory is not the stash's
        p.grad = torch.zeros_like(p)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(CUDA)
    out = stage(x)
    stash = WStash()
    dx = backward_input(out, grad_out, x, stash)
    del out, dx
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated(CUDA) - base
    expected = storage_bytes(stash.tensors + stash.gradients)
    assert expected > 0
    assert abs(held - expected) <= 0.02 * expected + (1 << 20), (held, expected)
    stash.run()
    del stash
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(CUDA) - base <= (1 << 20)


def test_split_aware_function_defers_on_the_device_thread() -> None:
    """A user's split-aware Function (tests' copy of the docs' one) runs its backward
    on CUDA's autograd thread, not this one, and still defers to W."""
    threads = []

    @split.split_aware
    class Gain(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, gain):
            ctx.save_for_backward(x, gain)
            return x * gain

        @staticmethod
        def backward(ctx, dy):
            threads.append(threading.get_ident())
            x, gain = ctx.saved_tensors
            split.defer(ctx, lambda: split.accumulate_grad(gain, (dy * x).sum(0)), (x,), (dy,))
            return dy * gain, None

    gain = nn.Parameter(torch.ones(16, device=CUDA))
    x = torch.randn(8, 16, device=CUDA, requires_grad=True)
    out = Gain.apply(x, gain)
    stash = WStash()
    backward_input(out, torch.ones_like(out), x, stash)
    assert gain.grad is None and threads and threads[0] != threading.get_ident()
    stash.run()
    torch.testing.assert_close(gain.grad, x.detach().sum(0))


def test_profile_on_cuda() -> None:
    """`ppdsl profile` on cuda:0: T_W > 0 and M_W > 0 per stage, split bytes equal to
    the plain stage's, and the transfer says what it measured on one GPU."""
    from ppdsl.runtime.measure.profile import profile_model

    profile = profile_model(TINY, 2, 8, CUDA, warmup=2, repeats=5)
    for s in profile.stages:
        assert s.timing.weight_ms > 0 and s.timing.weight_bytes > 0
        assert s.timing.activation_bytes == s.timing.plain_activation_bytes
    if torch.cuda.device_count() == 1:
        assert "one GPU" in profile.transfer_method


def test_trace_uses_cuda_events() -> None:
    """The tracer times a CUDA pass with events: a large matmul's slice lasts."""
    from ppdsl.runtime.execution.trace import Tracer

    tracer = Tracer(0, CUDA)
    tracer.start()
    a = torch.randn(4096, 4096, device=CUDA)
    tracer.begin()
    for _ in range(5):
        a = a @ a / 64
    tracer.end("F0", "F", {}, ("F", 0))
    tracer.timed = True
    tracer.flush()
    (event,) = tracer.events
    assert event["dur"] > 100 and tracer.durations[("F", 0)][0] > 0.1


@pytest.mark.skipif(torch.cuda.device_count() != 1, reason="a one-GPU machine")
def test_run_two_ranks_on_a_one_gpu_machine(tmp_path: Path) -> None:
    """`ppdsl run -D d=2` on a machine with one GPU trains on CPU after a one-line
    note (not `invalid device ordinal`); `--device cuda` is exit 2."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    base = [sys.executable, "-m", "ppdsl", "run", str(ROOT / "examples" / "zb_h1.pp"),
            "-D", "d=2", "--model", TINY, "--steps", "2"]
    proc = subprocess.run(base, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 GPU for 2 local ranks" in proc.stderr
    proc = subprocess.run([*base, "--device", "cuda"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 2 and "needs one GPU per rank" in proc.stderr


def test_one_rank_trains_on_cuda_with_nccl(tmp_path: Path) -> None:
    """A one-rank schedule (every stage on cuda:0) trains through the generated
    program with NCCL, the split on (ZB-H1), and measures its memory: the CUDA
    peak within 5% of the one predicted in bytes (`memory.predicted_device_peak`)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "ppdsl", "run", str(ROOT / "examples" / "zb_h1.pp"), "-D", "d=1",
         "-D", "m=4", "--model", TINY, "--steps", "3", "--device", "cuda"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cuda (nccl)" in proc.stdout and "cuda peak" in proc.stdout
    measured, predicted = map(int, re.search(r"cuda peak (\d+) B \(predicted (\d+) B\)",
                                             proc.stdout).groups())
    assert abs(measured / predicted - 1) <= 0.05, proc.stdout


def test_training_features_on_cuda(tmp_path: Path) -> None:
    """One rank on cuda:0 with NCCL: fp16 autocast with the loss scale on the GPU,
    post-validated clipping (an async all-reduce on NCCL), a checkpoint with CUDA
    tensors and RNG states, stopped after 2 steps and resumed to 4; then bf16.
    Each run exits 0 with finite losses."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    base = [sys.executable, "-m", "ppdsl", "run", str(ROOT / "examples" / "zb_h1.pp"), "-D", "d=1",
            "-D", "m=4", "--model", TINY.replace(":stages", ":stages_dropout"), "--steps", "4",
            "--device", "cuda", "--clip-grad-norm", "1", "--optimizer-validation", "post"]
    fp16 = ["--precision", "fp16", "--checkpoint-dir", str(tmp_path / "ckpt")]
    # bf16 in a checkpoint folder of its own: the fp16 one is at step 4 (it would resume there)
    for extra in ([*fp16, "--stop-after", "2"], [*fp16, "--resume"],
                  ["--precision", "bf16", "--checkpoint-dir", str(tmp_path / "ckpt-bf16")]):
        proc = subprocess.run([*base, *extra], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses = [float(line.split("loss")[1].split()[0]) for line in proc.stdout.splitlines()
                  if line.startswith("step ")]
        assert losses and all(math.isfinite(x) for x in losses), proc.stdout
    assert (tmp_path / "ckpt" / "step-00000004" / ".metadata").is_file()


def test_data_parallel_modes_on_cuda_with_nccl() -> None:
    """A 1 x 1 ("dp", "pp") mesh on cuda:0 with NCCL: replicate's async all-reduce
    and shard's FSDP2 gathers and reduce-scatters (CUDA streams) leave the
    parameters of 3 steps equal to the plain runner's (tests/dist/dp_one_rank.py;
    several replicas need several GPUs, so the dp x pp matrix runs on gloo)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    from tests.dist.harness import free_port

    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port",
         str(free_port()), str(ROOT / "tests" / "dist" / "dp_one_rank.py"), "cuda"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["replicate"] <= 1e-5 and found["shard"] <= 1e-5, found


def test_ranks_sharing_the_gpu_equal_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ZB-H1 and ZB-V at d=2, both ranks on cuda:0 in a gloo group (transfers
    staged through pinned host memory, docs/runtime.md, Devices): loss, gradients
    and the parameters after 3 steps equal a one-process run (1e-5 relative)."""
    from tests.dist import harness
    from tests.dist.cases import build_cases

    monkeypatch.setenv("PPDSL_TEST_BACKEND", "shared")
    cases = build_cases(2, tmp_path, only=["zb_h1", "zb_v"])
    results = harness.run_cases(cases, 2, tmp_path, timeout=300)
    for case in cases:
        for r in results[case["id"]]:
            assert "error" not in r, r["error"] + r.get("traceback", "")
            assert r["grad_rel_err"] <= 1e-5 and r["param_rel_err"] <= 1e-5, r


def test_profile_times_by_cuda_events_and_records_precision() -> None:
    """`ppdsl profile` on cuda:0 in bf16: the clock is CUDA events, the precision
    and TF32 settings are recorded, and the bf16 M_B is below fp32's."""
    from ppdsl.runtime.measure.profile import profile_model

    bf16 = profile_model(TINY, 2, 8, CUDA, warmup=1, repeats=3, transfer=False, precision="bf16")
    fp32 = profile_model(TINY, 2, 8, CUDA, warmup=1, repeats=3, transfer=False)
    assert bf16.clock == "cuda-events" and bf16.precision == "bf16" and "matmul" in bf16.tf32
    for a, b in zip(bf16.stages, fp32.stages, strict=True):
        assert 0 < a.timing.activation_bytes < b.timing.activation_bytes
        assert a.timing.forward_ms > 0 and a.timing.weight_ms > 0

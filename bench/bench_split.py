"""The B/W split's cost (ppdsl.runtime.execution.split), plain vs split, per layer kind and
for tiny_gpt stages, measured in the same run by `ppdsl.runtime.measure.stages.measure_stage`
(the plain run and the split run alternate; medians of 30 after 5 warm-up).

Times are this thread's CPU time (`time.thread_time`, torch on one thread), so
other work on the machine does not land in one column only. Each row runs in a
fresh process: what an earlier row left (a heap grown by 16 MB tensors, caches)
would otherwise move a later row's numbers by several percent. Targets (issue 8):
forward within 5% of the plain stage's, activation bytes after F within 1%,
T_I + T_W <= 1.10 T_B (fused). `norms` is `split.backward_input`'s: "in-b" (the
default, the zero-bubble paper's choice) computes layer norms' weight gradients
in B, "deferred" defers them to W too; rows without a layer norm do not depend on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from ppdsl.runtime.execution.split import NORMS
from ppdsl.runtime.measure.records import StageTiming
from ppdsl.runtime.measure.stages import measure_stage
from ppdsl.runtime.models.model import build_model
from ppdsl.runtime.worker.cpu import keep_freed_memory

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "examples" / "models" / "tiny_gpt.py") + ":stages"
WARMUP, REPEATS = 5, 30


def _layer(module: nn.Module, make: Callable[[], torch.Tensor], norms: str = "in-b") -> StageTiming:
    torch.manual_seed(0)
    x = make()
    with torch.no_grad():
        out = module(x)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    return measure_stage(module, lambda: x, lambda y: y, grad, torch.device("cpu"),
                         warmup=WARMUP, repeats=REPEATS, clock=time.thread_time, norms=norms)


def _tiny(stage_index: int, microbatch: int, norms: str) -> StageTiming:
    model = build_model(TINY, 2)
    ids, targets = model.batch(0, microbatch)
    if stage_index == 0:
        stage, x = model.stage(0), ids
        with torch.no_grad():
            out = stage(x)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        return measure_stage(stage, lambda: x, lambda y: y, grad, torch.device("cpu"),
                             warmup=WARMUP, repeats=REPEATS, clock=time.thread_time, norms=norms)
    with torch.no_grad():
        x = model.stage(0)(ids)
    return measure_stage(model.stage(1), lambda: x, lambda y: model.loss(y, targets), None,
                         torch.device("cpu"), warmup=WARMUP, repeats=REPEATS,
                         clock=time.thread_time, norms=norms)


def _cases() -> list[tuple[str, str, str, Callable[[], StageTiming]]]:
    cases: list[tuple[str, str, str, Callable[[], StageTiming]]] = [
        ("Linear", "2048x512 -> 2048", "",
         lambda: _layer(nn.Linear(512, 2048), lambda: torch.randn(2048, 512))),
        ("Linear, tiny", "32x32 -> 96", "",
         lambda: _layer(nn.Linear(32, 96), lambda: torch.randn(32, 32))),
    ]
    for norms in NORMS:
        cases.append(("LayerNorm", "4096x1024", norms,
                      lambda n=norms: _layer(nn.LayerNorm(1024), lambda: torch.randn(4096, 1024), n)))
    cases += [
        ("Embedding", "8x512 of 8192x512", "",
         lambda: _layer(nn.Embedding(8192, 512), lambda: torch.randint(0, 8192, (8, 512)))),
        ("Conv1d", "8x64x1024, k3", "",
         lambda: _layer(nn.Conv1d(64, 64, 3, padding=1), lambda: torch.randn(8, 64, 1024))),
        ("Conv2d", "8x32x64x64, k3", "",
         lambda: _layer(nn.Conv2d(32, 32, 3, padding=1), lambda: torch.randn(8, 32, 64, 64))),
    ]
    for stage_index, microbatch in ((0, 2), (1, 2), (1, 32)):
        for norms in NORMS:
            cases.append((f"tiny_gpt stage {stage_index}/2", f"microbatch {microbatch}", norms,
                          lambda s=stage_index, m=microbatch, n=norms: _tiny(s, m, n)))
    return cases


def _measure(case: int) -> None:
    """Run one case here and print its timing as a JSON line (the child's side)."""
    torch.set_num_threads(1)
    keep_freed_memory()  # as `ppdsl run` and `ppdsl profile` do on CPU
    print(json.dumps(asdict(_cases()[case][3]())))


def main() -> None:
    print(f"CPU, 1 thread, thread CPU time; median of {REPEATS} after {WARMUP} warm-up;"
          " one process per row")
    print(
        f"{'layer':<19} {'size':<18} {'norms':<8} {'plain F':>8} {'split F':>8} {'F x':>6}"
        f" {'M_B x':>6} {'T_B':>8} {'T_I':>8} {'T_W':>8} {'(I+W)/B':>7} {'M_W/M_B':>7}"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for case, (name, size, norms, _) in enumerate(_cases()):
        child = subprocess.run([sys.executable, "-m", "bench.bench_split", "--case", str(case)],
                               capture_output=True, text=True, env=env, cwd=ROOT, check=True)
        t = StageTiming(**json.loads(child.stdout.strip().splitlines()[-1]))
        print(
            f"{name:<19} {size:<18} {norms or '-':<8} {t.plain_forward_ms:8.3f} {t.forward_ms:8.3f}"
            f" {t.forward_ratio:6.3f} {t.bytes_ratio:6.3f} {t.fused_ms:8.3f} {t.input_ms:8.3f}"
            f" {t.weight_ms:8.3f} {t.backward_ratio:7.3f}"
            f" {t.weight_bytes / max(t.activation_bytes, 1):7.3f}",
            flush=True,
        )
    print("times in ms; F x = split F / plain F; M_B x = bytes after F, split / plain;"
          " (I+W)/B = (T_I + T_W) / T_B (fused); norms: where layer norms' weight gradients"
          " go (in-b: B, the default; deferred: W)")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--case":
        _measure(int(sys.argv[2]))
    else:
        main()

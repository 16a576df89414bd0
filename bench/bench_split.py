"""The B/W split's cost (ppdsl.runtime.split), plain vs split, per layer kind and
for tiny_gpt stages, measured in the same run by `ppdsl.runtime.profile.measure_stage`
(the plain run and the split run alternate; medians of 20 after 5 warm-up).

Times are this thread's CPU time (`time.thread_time`, torch on one thread), so
other work on the machine does not land in one column only. Targets (issue 8):
forward within 5% of the plain stage's, activation bytes after F within 1%,
T_I + T_W <= 1.10 T_B (fused)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ppdsl.runtime.cpu import keep_freed_memory
from ppdsl.runtime.model import build_model
from ppdsl.runtime.profile import StageTiming, measure_stage

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "examples" / "models" / "tiny_gpt.py") + ":stages"
WARMUP, REPEATS = 5, 20


def _layer(module: nn.Module, make: Callable[[], torch.Tensor]) -> StageTiming:
    torch.manual_seed(0)
    x = make()
    with torch.no_grad():
        out = module(x)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    return measure_stage(module, lambda: x, lambda y: y, grad, torch.device("cpu"),
                         warmup=WARMUP, repeats=REPEATS, clock=time.thread_time)


def _tiny(stage_index: int, microbatch: int) -> StageTiming:
    model = build_model(TINY, 2)
    ids, targets = model.batch(0, microbatch)
    if stage_index == 0:
        stage, x = model.stage(0), ids
        with torch.no_grad():
            out = stage(x)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        return measure_stage(stage, lambda: x, lambda y: y, grad, torch.device("cpu"),
                             warmup=WARMUP, repeats=REPEATS, clock=time.thread_time)
    with torch.no_grad():
        x = model.stage(0)(ids)
    return measure_stage(model.stage(1), lambda: x, lambda y: model.loss(y, targets), None,
                         torch.device("cpu"), warmup=WARMUP, repeats=REPEATS,
                         clock=time.thread_time)


def _cases() -> list[tuple[str, str, Callable[[], StageTiming]]]:
    return [
        ("Linear", "2048x512 -> 2048", lambda: _layer(nn.Linear(512, 2048), lambda: torch.randn(2048, 512))),
        ("LayerNorm", "4096x1024", lambda: _layer(nn.LayerNorm(1024), lambda: torch.randn(4096, 1024))),
        ("Embedding", "8x512 of 8192x512",
         lambda: _layer(nn.Embedding(8192, 512), lambda: torch.randint(0, 8192, (8, 512)))),
        ("Conv1d", "8x64x1024, k3",
         lambda: _layer(nn.Conv1d(64, 64, 3, padding=1), lambda: torch.randn(8, 64, 1024))),
        ("Conv2d", "8x32x64x64, k3",
         lambda: _layer(nn.Conv2d(32, 32, 3, padding=1), lambda: torch.randn(8, 32, 64, 64))),
        ("tiny_gpt stage 0/2", "microbatch 2", lambda: _tiny(0, 2)),
        ("tiny_gpt stage 1/2", "microbatch 2", lambda: _tiny(1, 2)),
        ("tiny_gpt stage 1/2", "microbatch 32", lambda: _tiny(1, 32)),
    ]


def main() -> None:
    torch.set_num_threads(1)
    keep_freed_memory()  # as `ppdsl run` and `ppdsl profile` do on CPU
    print(f"CPU, 1 thread, thread CPU time; median of {REPEATS} after {WARMUP} warm-up")
    print(
        f"{'layer':<19} {'size':<18} {'plain F':>8} {'split F':>8} {'F x':>6}"
        f" {'M_B x':>6} {'T_B':>8} {'T_I':>8} {'T_W':>8} {'(I+W)/B':>7} {'M_W/M_B':>7}"
    )
    for name, size, run in _cases():
        t = run()
        print(
            f"{name:<19} {size:<18} {t.plain_forward_ms:8.3f} {t.forward_ms:8.3f}"
            f" {t.forward_ratio:6.3f} {t.bytes_ratio:6.3f} {t.fused_ms:8.3f} {t.input_ms:8.3f}"
            f" {t.weight_ms:8.3f} {t.backward_ratio:7.3f}"
            f" {t.weight_bytes / max(t.activation_bytes, 1):7.3f}",
            flush=True,
        )
    print("times in ms; F x = split F / plain F; M_B x = bytes after F, split / plain;"
          " (I+W)/B = (T_I + T_W) / T_B (fused)")


if __name__ == "__main__":
    main()

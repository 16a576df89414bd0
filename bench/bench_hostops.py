"""The host's work per pass (issue 39): on `ppdsl.runtime.measure.hostops`'
fixed small stage (two stages of two Linear-GELU-Linear-LayerNorm blocks, width
16, 8 rows a microbatch, every stage on one rank), per pass kind, the Python calls
and dispatcher ops one pass makes (steady state: the same every step) and the
host microseconds one pass takes (its kernels are tiny: a pass's time is the
engine's and the split's Python around them, and torch's dispatch), median of
30 steps after 5 warm-up, CPU, one thread.

V-ZB runs F, B (the input gradient, "I" in torch's notation) and W; interleaved
1F1B runs F and BW (the fused backward). `tests/runtime/measure/test_hostops.py`
holds the counts under ceilings; bench/results/hostops.md keeps the numbers
before and after the engine's and the split's per-shape plans."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from ppdsl.runtime.measure.hostops import count_host_ops, host_seconds, small_engine

ROOT = Path(__file__).resolve().parent.parent
SCHEDULES = ("v_zb", "interleaved_1f1b")
WARMUP, STEPS = 5, 30


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="hostops-") as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(str(Path(tmp) / "store"), 1),
                                rank=0, world_size=1)
        try:
            print(f"CPU, 1 thread, torch {torch.__version__}; per pass, steady state; "
                  f"host us: median of {STEPS} steps after {WARMUP} warm-up")
            print(f"{'schedule':<18} {'pass':<4} {'Python calls':>12} {'torch ops':>9} {'host us':>8}")
            for name in SCHEDULES:
                engine, batch = small_engine(ROOT / "examples" / f"{name}.pp")
                seconds = host_seconds(engine, batch, warmup=WARMUP, steps=STEPS)
                for kind, ops in count_host_ops(engine, batch).items():
                    print(f"{name:<18} {kind:<4} {ops.python_calls:12.1f} {ops.torch_ops:9.1f}"
                          f" {seconds[kind] * 1e6:8.1f}", flush=True)
        finally:
            dist.destroy_process_group()
    print("Python calls: Python functions and C functions called from Python (sys.setprofile);"
          " torch ops: operators through the dispatcher (TorchDispatchMode)")


if __name__ == "__main__":
    main()

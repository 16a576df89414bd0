"""What optimizer post-validation (the zero-bubble paper's §4) removes from the
step time, measured with sleep-timed passes at d = 4.

Stages whose F, B and W sleep 10 ms each (examples/models/sleepy.py) on 4 gloo
CPU ranks, m = 8, and an optimizer whose step sleeps 20 ms (a large model's
step); gradient norm and inf/NaN flags checked every step (no clipping
triggers). Time per step over 8 steps after 2 of warm-up, from rank 0, both
validations in the same process group.

sync: every rank waits for the all-reduce of the norm (the slowest rank's last
pass), then steps, so rank 0 starts the next step at makespan + optimizer.
post: each rank steps as soon as its own gradients are final and waits for the
reduction only before its next first pass, so rank 0 starts the next step at
max(its own end + optimizer, makespan). Post removes the optimizer step from the
step time where rank 0 finishes before the others (ZB-H2 and ZB-V end in a
parallelogram: rank 0 three units early at d=4), and nothing where rank 0 ends
last (1F1B, ZB-H1). `predicted` is that rule applied to the simulated timeline
(rank 0's span and the makespan in 10 ms units, plus 20 ms)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
D = 4
UNIT_MS = 10.0
OPTIMIZER_MS = 20.0
SCHEDULES = [("1F1B", "1f1b"), ("ZB-H1", "zb_h1"), ("ZB-H2", "zb_h2"), ("ZB-V", "zb_v")]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    from ppdsl.compiler import compile_file

    predicted: dict[str, tuple[float, float]] = {}
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for _label, stem in SCHEDULES:
            compiled = compile_file(ROOT / "examples" / f"{stem}.pp", {"d": str(D), "m": str(2 * D)})
            path = Path(tmp) / f"{stem}.pickle"
            path.write_bytes(pickle.dumps((compiled.schedule, compiled.programs)))
            makespan = float(compiled.timeline.makespan) * UNIT_MS
            end0 = float(compiled.timeline.span_end[0]) * UNIT_MS
            predicted[stem] = (makespan + OPTIMIZER_MS, max(end0 + OPTIMIZER_MS, makespan))
            for validation in ("sync", "post"):
                cases.append({"id": f"{stem}-{validation}", "pickle": str(path),
                              "validation": validation, "optimizer_ms": OPTIMIZER_MS,
                              "warmup": 2, "steps": 8})
        cases_file = Path(tmp) / "cases.json"
        cases_file.write_text(json.dumps(cases))
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
                   PPDSL_SLEEP_MS=f"F={UNIT_MS:g},B={UNIT_MS:g},W={UNIT_MS:g}")
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(D),
             "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
             str(ROOT / "bench" / "_post_validation_worker.py"), str(cases_file)],
            capture_output=True, text=True, env=env, cwd=ROOT, timeout=900,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"the bench ranks failed:\n{proc.stderr[-3000:]}")
    found = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            found[row["id"]] = row["period_ms"]
    print(f"sleepy stages (F = B = W = {UNIT_MS:g} ms), optimizer step {OPTIMIZER_MS:g} ms, "
          f"d = {D}, m = {2 * D}, gloo CPU ranks; ms per step (8 steps after 2)")
    print(f"{'schedule':<8} {'sync ms':>8} {'post ms':>8} {'removed':>8} {'post/sync':>9}"
          f"  {'predicted sync':>14} {'post':>6}")
    for label, stem in SCHEDULES:
        sync, post = found[f"{stem}-sync"], found[f"{stem}-post"]
        p_sync, p_post = predicted[stem]
        print(f"{label:<8} {sync:8.1f} {post:8.1f} {sync - post:8.1f} {post / sync:9.3f}"
              f"  {p_sync:14.1f} {p_post:6.1f}")



if __name__ == "__main__":
    main()

"""Does the simulator predict the runtime? Sleep-timed stages
(examples/models/sleepy.py: F 20 ms, B 20 ms, W 10 ms, real gradients) on d gloo
CPU ranks: `ppdsl profile` measures them (pass times and the transfer), `ppdsl run
--costs-from` the profile trains m = 2d microbatches, and the run's median step
time (slowest rank, steps 2..N) is set against the simulated makespan under the
profile's costs, both from the same run's output. Target (issue 8): measured /
predicted <= 1.05."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = str(ROOT / "examples" / "models" / "sleepy.py") + ":stages"
STEPS = 6
SCHEDULES = [("1F1B", "1f1b"), ("ZB-H1", "zb_h1")]


def _ppdsl(*argv: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PPDSL_SLEEP_MS="F=20,B=20,W=10")
    proc = subprocess.run([sys.executable, "-m", "ppdsl", *argv], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"ppdsl {' '.join(argv)} failed:\n{proc.stderr[-2000:]}")
    return proc


def main() -> None:
    print(f"sleepy stages (F 20, B 20, W 10 ms), gloo CPU ranks on loopback, m = 2d, "
          f"median step of {STEPS - 1} after the first")
    print(f"{'schedule':<8} {'d':>2} {'m':>3} {'measured ms':>11} {'predicted ms':>12} "
          f"{'meas/pred':>9} {'pred. from run':>14} {'meas/run':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for d in (2, 3, 4):
            costs = Path(tmp) / f"costs{d}.pp"
            _ppdsl("profile", "--model", MODEL, "--stages", str(d), "--warmup", "1",
                   "--repeats", "5", "-o", str(costs))
            for label, stem in SCHEDULES:
                out = Path(tmp) / f"{stem}-{d}"
                _ppdsl("run", str(ROOT / "examples" / f"{stem}.pp"), "-D", f"d={d}",
                       "-D", f"m={2 * d}", "--model", MODEL, "--steps", str(STEPS),
                       "--costs-from", str(costs), "--json", str(out))
                r = json.loads((out / "rank0.json").read_text())
                measured, predicted = r["median_step_time_ms"], r["predicted_step_time_ms"]
                again = r["resimulated_step_time_ms"]
                print(f"{label:<8} {d:>2} {2 * d:>3} {measured:11.1f} {predicted:12.1f} "
                      f"{measured / predicted:9.3f} {again:14.1f} {measured / again:8.3f}",
                      flush=True)
    print("predicted: the simulator's makespan under the profile's costs; pred. from run: "
          "under the run's own median pass times (and the profile's transfer cost)")


if __name__ == "__main__":
    main()

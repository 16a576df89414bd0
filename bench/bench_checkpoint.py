"""Checkpoints every step: what a save costs the step, in the background
(`dcp.async_save`, ppdsl's default) and written before the next step
(`--sync-checkpoints`), against no checkpoint, in one run of this bench.

ZB-H1 at d=2, m=4 on 2 gloo CPU processes; each stage is a sleepy stage
(examples/models/sleepy.py: F = B = 20 ms, W = 10 ms, sleeping, so the ranks do
not compete for cores) carrying a parameter of BULK floats, so that each rank's
checkpoint holds ~BULK * 4 bytes of weights (plus the optimizer state of the
trained parameters). Step time: the run's own median over steps 2.. (slowest
rank). `--quick`: a quarter of the bulk and fewer steps."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_STEP = re.compile(r"measured step time ([\d.]+) ms")


def _step_ms(extra: list[str], bulk: int, steps: int) -> float:
    env = dict(os.environ, PPDSL_SLEEP_PARAMS=str(bulk), PPDSL_SLEEP_MS="F=20,B=20,W=10",
               OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "ppdsl", "run", "examples/zb_h1.pp", "-D", "d=2", "-D", "m=4",
         "--model", "examples/models/sleepy.py:stages", "--steps", str(steps), "--optimizer",
         "sgd", *extra], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    found = _STEP.search(proc.stdout)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"ppdsl run {' '.join(extra)} failed:\n{proc.stdout}\n{proc.stderr}")
    return float(found.group(1))


def main() -> None:
    quick = "--quick" in sys.argv
    bulk, steps = (1 << 19, 6) if quick else (1 << 21, 10)
    with tempfile.TemporaryDirectory(prefix="ppdsl-bench-ckpt-") as tmp:
        rows = [
            ("none", _step_ms([], bulk, steps)),
            ("async, every step", _step_ms(["--checkpoint-dir", f"{tmp}/a",
                                            "--checkpoint-every", "1"], bulk, steps)),
            ("sync, every step", _step_ms(["--checkpoint-dir", f"{tmp}/s", "--checkpoint-every",
                                           "1", "--sync-checkpoints"], bulk, steps)),
        ]
    base = rows[0][1]
    print(f"ZB-H1 d=2 m=4, sleepy stages (F=B=20 ms, W=10 ms), {bulk * 4 / 2**20:.0f} MiB of "
          f"weights per stage, {steps} steps; step time = median over steps 2..")
    print(f"{'checkpoints':<20} {'step ms':>9} {'/ none':>7}")
    for name, ms in rows:
        print(f"{name:<20} {ms:9.1f} {ms / base:7.2f}")


if __name__ == "__main__":
    main()

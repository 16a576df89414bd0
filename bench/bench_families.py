"""Families (issue 41, docs/testing.md): the time of `ppdsl check --for` and
`--symbolic` on the issue's targets, as processes (`python -m ppdsl check`).

- ZB-V enumerated for d = 2..32, m = d..4d (1,612 instances, 496 outside its
  `require m >= 2d - 1`), one process and `--jobs 2`;
- ZB-H1, 1F1B and ZB-H2 proven by `--symbolic` for 2 <= d <= 10,000.

Wall seconds and the CPU seconds of the process and its children. `--quick`
enumerates d = 2..8 only.

Measured (2 cores shared with four other jobs, load average 10-15 throughout,
so wall times are 5-7x the CPU): ZB-V d=2..32 one process 98 s CPU, 700 s
wall; `--jobs 2` 90 s CPU, 614 s wall (on two idle cores about 45-50 s).
Branch zbv41 (order bodies for all devices at once, the body compiled once
per family, delta_table in integers), one process under `nice -n 10`: 28.5 s
CPU (262 s wall at load average 9-13) and 29.7 s CPU (165 s wall at load
19-23); per instance at d = 8..32 (process_time) 88.6 ms on main, 28.6 ms
here. On two idle cores that is about 30 s; under the load above, not 60.
Symbolic: ZB-H1 4.7 s wall (1.4 s CPU), 1F1B 4.6 s (1.7 s CPU), most of it
importing ortools."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _timed(argv: list[str]) -> tuple[float, float, int, str]:
    """(wall s, CPU s of the child processes, exit code, last stdout line) of `ppdsl argv`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PPDSL_PROGRESS": "0"}
    done = subprocess.run([sys.executable, "-m", "ppdsl", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = (done.stdout or done.stderr).strip().splitlines()
    return wall, cpu, done.returncode, lines[0] if lines else ""


def main() -> None:
    high = 8 if "--quick" in sys.argv else 32
    rows = [
        (f"zb_v d=2..{high} m=d..4d", ["check", "examples/zb_v.pp", "--for", f"d=2..{high}",
                                      "--for", "m=d..4*d"]),
        (f"zb_v d=2..{high} m=d..4d --jobs 2",
         ["check", "examples/zb_v.pp", "--for", f"d=2..{high}", "--for", "m=d..4*d",
          "--jobs", "2"]),
        *((f"{name} --symbolic d=2..10000",
           ["check", f"examples/{name}.pp", "--for", "d=2..10000", "--symbolic"])
          for name in ("zb_h1", "1f1b", "zb_h2")),
    ]
    print(f"{'what':42} {'wall s':>8} {'cpu s':>8} {'exit':>4}  result")
    for what, argv in rows:
        wall, cpu, code, line = _timed(argv)
        print(f"{what:42} {wall:8.1f} {cpu:8.1f} {code:4d}  {line[:90]}", flush=True)
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()

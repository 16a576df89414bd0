"""The compiler at cluster scale (issue 13): ZB-V (examples/zb_v.pp) at d stages
pairs and m microbatches, measured as a user runs it: one `ppdsl check`, `ppdsl
stats --json` and `ppdsl compile` process each, wall time and peak RSS from the
child's own rusage (os.wait4). Start-up is separated: the same command on
d=2, m=4 (24 passes) is each command's start-up, and "above" is the big run
minus it; memory per pass is (peak - start-up peak) / passes.

Targets: d=64 m=1024 check <= 2 s, compile <= 4 s; d=128 m=2048 check <= 6 s;
<= 0.3 KB per pass; a small file's check <= 0.5 s. `--quick` runs d=64 only.
Machine load (os.getloadavg) is printed: 2 shared cores make timings noisy.

A second table checks the block-form examples (a building block repeated m
times, then warm-up and cool-down tightened) at d=64 m=1024, against ZB-V's
order form at the same size: no target of their own, the ratio says how far
the block form is from the order form."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILE = str(ROOT / "examples" / "zb_v.pp")
SIZES = [(64, 1024), (128, 2048)]
BLOCKS = ["1f1b", "zb_h1", "zb_h2", "interleaved_1f1b", "v_zb"]
"""Block-form examples the second table checks at d=64, m=1024."""
TARGETS = {("check", 64): 2.0, ("compile", 64): 4.0, ("check", 128): 6.0}


def _run(argv: list[str]) -> tuple[float, float, float]:
    """(wall s, peak RSS MB, CPU s: user + system) of one `python -m ppdsl ARGV`
    process (CPU time is what the shared cores' load inflates least)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "ppdsl", *argv], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.stderr:
        proc.stderr.close()
    if proc.returncode != 0:
        raise RuntimeError(f"ppdsl {' '.join(argv)} exited {proc.returncode}:\n{err[-2000:]}")
    return wall, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime  # ru_maxrss: KB


def _argv(command: str, d: int, m: int, out: str, file: str = FILE) -> list[str]:
    sizes = ["-D", f"d={d}", "-D", f"m={m}"]
    if 6 * d * m > 1_000_000:  # past the default --max-passes (issue 14's limits)
        sizes += ["--max-passes", str(6 * d * m)]
    if command == "check":
        return ["check", file, *sizes]
    if command == "stats":
        return ["stats", "--json", FILE, *sizes]
    return ["compile", FILE, *sizes, "-o", out]


def _best(argv: list[str], repeats: int) -> tuple[float, float, float]:
    runs = [_run(argv) for _ in range(repeats)]
    return min(r[0] for r in runs), max(r[1] for r in runs), min(r[2] for r in runs)


def main() -> None:
    quick = "--quick" in sys.argv
    sizes = SIZES[:1] if quick else SIZES
    commands = ["check", "stats", "compile"]
    print(f"ZB-V ({FILE.rsplit('/', 1)[-1]}), one process per cell, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp:
        startup = {c: _best(_argv(c, 2, 4, tmp), 3) for c in commands}
        print("start-up (d=2, m=4, best of 3): " + ", ".join(
            f"{c} {w:.2f} s ({cpu:.2f} s CPU) / {r:.0f} MB" for c, (w, r, cpu) in startup.items()))
        print(f"{'d':>4} {'m':>5} {'passes':>8} {'command':>8} {'wall s':>7} {'CPU s':>6} "
              f"{'above s':>8} {'peak MB':>8} {'KB/pass':>8} {'target':>8}")
        peaks: dict[str, list[tuple[int, float]]] = {c: [] for c in commands}
        for d, m in sizes:
            passes = 6 * d * m  # F, B, W of m microbatches on 2d stages
            for c in commands:
                wall, rss, cpu = _run(_argv(c, d, m, tmp))
                peaks[c].append((passes, rss))
                s_wall, s_rss, _ = startup[c]
                target = TARGETS.get((c, d))
                verdict = "" if target is None else f"{'<=' if wall <= target else '>'} {target:g} s"
                per_pass = (rss - s_rss) * 1024 / passes
                print(f"{d:>4} {m:>5} {passes:>8} {c:>8} {wall:7.2f} {cpu:6.2f} {wall - s_wall:8.2f} "
                      f"{rss:8.0f} {per_pass:8.2f} {verdict:>8}", flush=True)
        if len(sizes) > 1:
            # the slope between the two sizes: memory per pass without fixed costs
            # (numba and llvmlite, loaded once a kernel's input is large, are ~100 MB)
            print("KB/pass between the two sizes: " + ", ".join(
                f"{c} {(b[1] - a[1]) * 1024 / (b[0] - a[0]):.2f}"
                for c, (a, b) in ((c, peaks[c][:2]) for c in commands)))
    print("KB/pass: (peak - start-up peak) / passes, target <= 0.3; start-up target: check "
          "of a small file <= 0.5 s")
    _blocks(quick)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def _blocks(quick: bool) -> None:
    """`check` of the block-form examples at d=64, m=1024 beside ZB-V's order form."""
    d, m = 64, 1024
    names = BLOCKS[:2] if quick else BLOCKS
    base, _, _ = _run(_argv("check", d, m, ""))
    print(f"\nblock form, check at d={d} m={m} (ZB-V's order form: {base:.2f} s)")
    print(f"{'example':>18} {'wall s':>7} {'CPU s':>6} {'peak MB':>8} {'x ZB-V':>7}")
    for name in names:
        file = str(ROOT / "examples" / f"{name}.pp")
        wall, rss, cpu = _run(_argv("check", d, m, "", file))
        print(f"{name:>18} {wall:7.2f} {cpu:6.2f} {rss:8.0f} {wall / base:7.2f}",
              flush=True)


if __name__ == "__main__":
    main()

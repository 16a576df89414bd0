"""The lines `ppdsl run` prints, compared between two checkouts with the numbers
that are times masked: a restructuring of the runtime must leave them equal.

    python -m tests.system.run_lines BEFORE_TREE AFTER_TREE

Each tree runs (with PYTHONPATH set to it) 1F1B at d=2, m=2 on the tiny GPT
with two data-parallel replicas, post-validated clipping, evaluation every 2
steps, a checkpoint every 2 steps, --json and --trace; then the same run
resumed to step 6 keeping one checkpoint. Losses, memory, digests and the
optimizer's tally are printed exactly; step times, rates, busy shares
measured, and the measured/predicted ratios are masked. Exit 0 when equal,
else 1 with the diff. Slow (four ranks on gloo, twice per tree): a check to
run by hand, not a test."""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

_COMMON = ["run", "examples/1f1b.pp", "-D", "d=2", "-D", "m=2",
           "--model", "examples/models/tiny_gpt.py:stages", "--dp", "2",
           "--clip-grad-norm", "0.5", "--eval-every", "2"]


def _masked(line: str, work: str) -> str:
    line = line.replace(work, "W")
    line = re.sub(r"time +[0-9.]+ ms +[0-9.]+ samples/s( +[0-9.]+ tokens/s)?",
                  "time T ms S samples/s K tokens/s", line)
    line = re.sub(r"(measured step time|predicted) [0-9.]+ ms", r"\1 T ms", line)
    line = re.sub(r"measured/predicted [0-9.]+", "measured/predicted R", line)
    if re.match(r"^ +\d+  \S+ ", line):  # a memory table row: its last column is a time share
        line = re.sub(r" +[0-9.]+$", " BUSY", line)
    return line


def lines(tree: Path) -> list[str]:
    """The masked lines of the two runs in `tree`."""
    with tempfile.TemporaryDirectory(prefix="run-lines-") as work:
        env = dict(os.environ, PYTHONPATH=str(tree))
        runs = [
            [*_COMMON, "--steps", "4", "--optimizer-validation", "post", "--checkpoint-dir",
             f"{work}/ck", "--checkpoint-every", "2", "--json", f"{work}/json", "--trace",
             f"{work}/trace.json"],
            [*_COMMON, "--steps", "6", "--checkpoint-dir", f"{work}/ck", "--resume",
             "--keep-checkpoints", "1"],
        ]
        out: list[str] = []
        for argv in runs:
            proc = subprocess.run([sys.executable, "-m", "ppdsl", *argv], cwd=tree, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=900)
            out += [_masked(line, work) for line in proc.stdout.splitlines()]
            out.append(f"exit {proc.returncode}")
        out += sorted(p.name for p in Path(work, "ck").iterdir())
        return out


def main(argv: list[str]) -> int:
    before, after = (lines(Path(tree).resolve()) for tree in argv)
    diff = list(difflib.unified_diff(before, after, "before", "after", lineterm=""))
    print("\n".join(diff) if diff else f"the same {len(after)} lines, times masked")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

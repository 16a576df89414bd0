"""ppdsl's runtime vs torch.distributed.pipelining: same tiny_gpt, same ranks (4
gloo CPU processes on loopback), same microbatches (m=8, 2 samples each), measured
in the same run. Step time is the mean over steps 2..N (each side times its own
steps: ppdsl the slowest rank's step, torch between two barriers)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = str(ROOT / "examples" / "models" / "tiny_gpt.py") + ":stages"
D, M, STEPS = 4, 8, 10

# (label, example .pp stem, torch schedule)
PAIRS = [
    ("1F1B", "1f1b", "1f1b"),
    ("ZB-V", "zb_v", "zbv"),
    ("interleaved 1F1B", "interleaved_1f1b", "interleaved"),
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(D),
           "--master-addr", "127.0.0.1", "--master-port", str(_port()), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)


def _ppdsl_schedule(stem: str):
    """The example compiled at D ranks and M microbatches (a compile error stops the bench)."""
    from ppdsl.compiler import compile_file

    c = compile_file(ROOT / "examples" / f"{stem}.pp", {"d": str(D), "m": str(M)})
    return f"examples/{stem}.pp", c.schedule, c.programs, c.timeline


def _ppdsl_time(schedule, programs, timeline) -> float:
    from ppdsl.backend.codegen import generate, write

    with tempfile.TemporaryDirectory() as tmp:
        write(generate(schedule, programs, timeline), tmp)
        out = Path(tmp) / "json"
        proc = _torchrun([str(Path(tmp) / "launch.py"), "--model", MODEL, "--steps", str(STEPS),
                          "--device", "cpu", "--json", str(out)])
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-2000:])
        ranks = [json.loads(p.read_text()) for p in out.glob("rank*.json")]
        return max(r["mean_step_time"] for r in ranks)


def _torch_time(kind: str) -> float:
    proc = _torchrun([str(ROOT / "bench" / "_torch_pipeline.py"), "--schedule", kind,
                      "--microbatches", str(M), "--steps", str(STEPS)])
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])["mean_step_time"]


def main() -> None:
    print(f"tiny_gpt, {D} gloo CPU ranks, m={M}, batch {2 * M}, mean of steps 2..{STEPS}")
    print(f"{'schedule':<18} {'ppdsl source':<30} {'ppdsl ms':>9} {'torch ms':>9} {'ppdsl/torch':>11}")
    for label, stem, kind in PAIRS:
        source, schedule, programs, timeline = _ppdsl_schedule(stem)
        ours = _ppdsl_time(schedule, programs, timeline)
        theirs = _torch_time(kind)
        print(f"{label:<18} {source:<30} {ours * 1e3:9.1f} {theirs * 1e3:9.1f} {ours / theirs:11.2f}",
              flush=True)


if __name__ == "__main__":
    main()

"""Start N local ranks the way torchrun does (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR=127.0.0.1, a free MASTER_PORT), without torchrun's own supervision, so
tests see what each rank does by itself (e.g. when a peer dies)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RankResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str


def start(argv: list[str], nproc: int, env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(nproc):
        rank_env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                        LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                        **(env or {}))
        procs.append(subprocess.Popen([sys.executable, *argv], env=rank_env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def finish(procs: list[subprocess.Popen], timeout: float) -> list[RankResult]:
    deadline = time.monotonic() + timeout
    results = []
    for rank, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, err = p.communicate()
            err += f"\n[harness: rank {rank} killed after {timeout} s]"
            results.append(RankResult(rank, -9, out, err))
            continue
        results.append(RankResult(rank, p.returncode, out, err))
    return results


def run(argv: list[str], nproc: int, timeout: float = 120,
        env: dict[str, str] | None = None) -> list[RankResult]:
    return finish(start(argv, nproc, env), timeout)


def run_cases(cases: list[dict], nproc: int, outdir: Path, timeout: float = 600,
              worker: str = "worker.py") -> dict:
    """Run every case in one process group of `nproc` ranks (tests/dist/`worker`);
    {case id: [per-rank dict]}."""
    outdir.mkdir(parents=True, exist_ok=True)
    cases_file = outdir / "cases.json"
    cases_file.write_text(json.dumps(cases))
    results = run([str(ROOT / "tests" / "dist" / worker), str(cases_file), str(outdir)],
                  nproc, timeout)
    found: dict = {}
    for case in cases:
        per_rank = []
        for r in range(nproc):
            path = outdir / f"{case['id']}.rank{r}.json"
            if path.exists():
                per_rank.append(json.loads(path.read_text()))
            else:
                log = "\n".join(f"rank {x.rank} rc={x.returncode}\n{x.stderr[-2000:]}"
                                for x in results)
                per_rank.append({"case": case["id"], "rank": r, "error": f"no result; {log}"})
        found[case["id"]] = per_rank
    return found

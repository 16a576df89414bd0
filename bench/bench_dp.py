"""Data parallel x pipeline: how much of the DP communication each order exposes
at small batch per replica (the breadth-first paper's comparison), predicted by
the compiler's communication lane and measured.

dp 2 x pp 2 on 4 gloo CPU processes, m = 4 microbatches per replica. The same
model in three schedules: looped BFS and interleaved 1F1B with v = 2 chunks per
device (each chunk a sleepy stage, F = B = W = 10 ms, and a `bulk` parameter of
BULK floats), and 1F1B with one stage per device (two chunks' worth: 20 ms
passes, 2 x BULK floats). The collectives are real gloo collectives on those
bytes; their times are measured first (median, every DP group at once) and
become `cost reduce` / `cost gather` per stage for the prediction.

exposed, measured: per rank, the time it waited for its collectives (a gather
not done by its stage's first F, reductions not done after its last pass;
`DataParallel.wait_time`), median over steps, the largest rank's. Predicted:
the largest device's exposed time on the lane (`ppdsl stats --dp 2`). replicate
reduces with an all-reduce; shard gathers each stage once per step (one stage
ahead) and reduce-scatters it after its last backward."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
D, M, UNIT_MS = 2, 4, 10.0
BULK = 1 << 23  # floats per chunk: 32 MiB
SCHEDULES = [("looped BFS", "looped_bfs", 1), ("interleaved 1F1B", "interleaved_1f1b", 1),
             ("1F1B", "1f1b", 2)]  # (label, example, chunks per stage)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _predicted(schedule, chunks: int, mode: str, times: dict[str, float]) -> float:
    """The largest device's exposed communication on the compiler's lane, in ms."""
    from ppdsl.analysis.collectives import comm_lanes
    from ppdsl.analysis.simulate import simulate
    from ppdsl.ir.schedule import Costs

    S = schedule.num_stages
    unit = UNIT_MS * chunks
    reduce = times["reduce" if mode == "replicate" else "reduce_scatter"]
    costs = Costs.of([unit] * S, [unit] * S, [unit] * S).with_collectives(
        {"reduce": [reduce] * S, "gather": [times["gather"]] * S})
    timed = replace(schedule, costs=costs)
    return max(comm_lanes(timed, simulate(timed), mode).exposed)


def main() -> None:
    from ppdsl.compiler import compile_file

    schedules = {}
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for _label, stem, chunks in SCHEDULES:
            compiled = compile_file(ROOT / "examples" / f"{stem}.pp", {"d": str(D), "m": str(M)})
            schedules[stem] = compiled.schedule
            path = Path(tmp) / f"{stem}.pickle"
            path.write_bytes(pickle.dumps((compiled.schedule, compiled.programs)))
            unit = UNIT_MS * chunks
            for mode in ("replicate", "shard"):
                cases.append({"id": f"{stem}-{mode}", "pickle": str(path), "mode": mode,
                              "sleep": f"F={unit:g},B={unit:g},W={unit:g}", "bulk": BULK * chunks,
                              "warmup": 2, "steps": 5})
        cases_file = Path(tmp) / "cases.json"
        cases_file.write_text(json.dumps(cases))
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(2 * D),
             "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
             str(ROOT / "bench" / "_dp_worker.py"), str(cases_file)],
            capture_output=True, text=True, env=env, cwd=ROOT, timeout=900,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"the bench ranks failed:\n{proc.stderr[-3000:]}")
    found, collectives = {}, {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            if "collectives" in row:
                collectives = row["collectives"]
            else:
                found[row["id"]] = row
    print(f"dp 2 x pp {D}, m = {M} per replica, sleepy chunks (F = B = W = {UNIT_MS:g} ms, "
          f"{BULK * 4 >> 20} MiB of parameters each), gloo CPU; ms, median of 5 steps after 2")
    for numel, t in sorted(collectives.items(), key=lambda kv: int(kv[0])):
        print(f"  {int(numel) * 4 >> 20} MiB: all-reduce {t['reduce']:.1f}, reduce-scatter "
              f"{t['reduce_scatter']:.1f}, all-gather {t['gather']:.1f}")
    print(f"{'schedule':<17} {'mode':<9} {'step ms':>8} {'exposed':>8} {'predicted':>9}")
    for label, stem, chunks in SCHEDULES:
        for mode in ("replicate", "shard"):
            row = found[f"{stem}-{mode}"]
            times = collectives[str(BULK * chunks)]
            predicted = _predicted(schedules[stem], chunks, mode, times)
            print(f"{label:<17} {mode:<9} {row['step_ms']:8.1f} {max(row['exposed_ms']):8.1f} "
                  f"{predicted:9.1f}")


if __name__ == "__main__":
    main()

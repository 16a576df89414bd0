"""Conformance of a measured trace (`ppdsl run --trace`) to the proven rank
programs: on every rank and in every step, each pass of the rank's program ran
exactly once and in the program's order, and every exchange posted exactly the
sends and receives of the program's exchange at that point (no rank waited on a
transfer the programs do not contain).

A trace is Chrome trace JSON: one "X" slice per pass (`cat` the pass kind,
`name` kind and microbatch, `args.stage`), per exchange (`cat` "exchange",
`args.sends` and `args.recvs` the transfers as `Transfer` prints them; a slice
named "wait" is a receive waited for just before the pass that takes it), and
per optimizer step and data batch; `pid` is the rank, `args.step` the step.
With data parallelism, rank r runs the program of pipeline rank r % num_ranks.
When the trace's ranks share one clock (`otherData.clock` "host": one host's
perf_counter from one epoch), causality too: no pass started before the
sender of a tensor it takes had posted it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ppdsl.ir.rank import Compute, Exchange, RankProgram, Transfer
from ppdsl.semantics import PassKind, transfer_passes

__all__ = ["TraceStep", "PASS_CATEGORIES", "steps_of", "check_trace"]

PASS_CATEGORIES = frozenset(k.value for k in PassKind)
"""The `cat` of a pass slice: its kind's letter."""


@dataclass(frozen=True)
class TraceStep:
    """One rank's slices of one step, in the order they started."""

    rank: int
    step: int
    events: tuple[dict[str, Any], ...]

    @property
    def passes(self) -> list[dict[str, Any]]:
        """The pass slices."""
        return [e for e in self.events if e.get("cat") in PASS_CATEGORIES]

    @property
    def exchanges(self) -> list[dict[str, Any]]:
        """The exchange slices: posting an exchange's transfers, and waiting for a
        receive just before the pass that takes it."""
        return [e for e in self.events if e.get("cat") == "exchange"]

    @property
    def posts(self) -> list[dict[str, Any]]:
        """The slices that post an exchange of the program (named "exchange")."""
        return [e for e in self.exchanges if e.get("name") != "wait"]


def steps_of(trace: dict[str, Any]) -> list[TraceStep]:
    """The trace's slices grouped by rank and step (sorted by both), each group
    in start order (ties in recording order)."""
    grouped: dict[tuple[int, int], list[tuple[float, int, dict[str, Any]]]] = {}
    for index, event in enumerate(trace.get("traceEvents", [])):
        if event.get("ph") != "X":
            continue
        key = (int(event["pid"]), int(event["args"]["step"]))
        grouped.setdefault(key, []).append((float(event["ts"]), index, event))
    return [
        TraceStep(rank, step, tuple(e for _, _, e in sorted(slices, key=lambda x: x[:2])))
        for (rank, step), slices in sorted(grouped.items())
    ]


def _pass_text(event: dict[str, Any]) -> str:
    return f"{event['name']} (stage {event['args'].get('stage')})"


def _program_pass_text(op: Compute) -> str:
    p = op.pass_
    return f"{p.kind.value}{p.microbatch} (stage {p.stage})"


def check_trace(
    where: str, trace: dict[str, Any], programs: Sequence[RankProgram]
) -> list[str]:
    """Every violation, located as `where: rank R, step S: ...`, sorted by rank
    and step; empty when the trace conforms."""
    num_ranks = len(programs)
    steps = steps_of(trace)
    findings: list[str] = []
    ranks = sorted({s.rank for s in steps})
    all_steps = sorted({s.step for s in steps})
    seen = {(s.rank, s.step) for s in steps}
    world = max(ranks, default=-1) + 1
    if world % num_ranks:
        findings.append(f"{where}: the trace has {world} ranks, not a multiple of the "
                        f"program's {num_ranks}: is it the trace of this schedule?")
        return findings
    for rank in range(world):
        for step in all_steps:
            if (rank, step) not in seen and programs[rank % num_ranks].ops:
                findings.append(f"{where}: rank {rank}, step {step}: no slice recorded "
                                "(the rank's passes are missing)")
    for trace_step in steps:
        program = programs[trace_step.rank % num_ranks]
        findings.extend(_check_step(f"{where}: rank {trace_step.rank}, step {trace_step.step}",
                                    trace_step, program))
    if not findings and trace.get("otherData", {}).get("clock") == "host":
        findings.extend(_check_causality(where, steps, programs))
    return findings


def _check_causality(where: str, steps: Sequence[TraceStep],
                     programs: Sequence[RankProgram]) -> list[str]:
    """On one clock: every pass that takes a tensor from another rank started
    after that rank began posting it (after the pass that made it ended)."""
    num_ranks = len(programs)
    transfers: dict[str, Transfer] = {str(t): t for p in programs for op in p.ops
                                      if isinstance(op, Exchange) for t in op.sends}
    started: dict[tuple[int, int, str, int, int], float] = {}
    for s in steps:
        for e in s.passes:
            key = (s.rank, s.step, e["cat"], int(e["args"]["microbatch"]), int(e["args"]["stage"]))
            started.setdefault(key, float(e["ts"]))
    findings = []
    for s in steps:
        for e in s.posts:
            for name in e["args"].get("sends", []):
                t = transfers.get(name)
                if t is None:
                    continue
                receiver = s.rank - s.rank % num_ranks + t.dst_rank
                for kind in sorted(k.value for k in transfer_passes(t.kind, sending=False)):
                    start = started.get((receiver, s.step, kind, t.microbatch, t.dst_stage))
                    if start is not None and start < float(e["ts"]):
                        findings.append(
                            f"{where}: rank {receiver}, step {s.step}: {kind}{t.microbatch} "
                            f"(stage {t.dst_stage}) started {(float(e['ts']) - start) / 1e3:.3f} "
                            f"ms before rank {s.rank} posted {name}, which it takes: the "
                            "trace's ranks are not on one clock, or the pass ran without "
                            "its input")
    return findings


def _check_step(at: str, step: TraceStep, program: RankProgram) -> list[str]:
    findings: list[str] = []
    expected = [_program_pass_text(op) for op in program.ops if isinstance(op, Compute)]
    ran = [_pass_text(e) for e in step.passes]
    counts: dict[str, int] = {}
    for text in ran:
        counts[text] = counts.get(text, 0) + 1
    wanted = set(expected)
    for text in expected:
        if counts.get(text, 0) == 0:
            findings.append(f"{at}: pass {text} of the program did not run")
    for text, n in counts.items():
        if text not in wanted:
            findings.append(f"{at}: pass {text} ran but is not in the rank's program")
        elif n > 1:
            findings.append(f"{at}: pass {text} ran {n} times, not once")
    if not findings and ran != expected:
        k = next(i for i, (a, b) in enumerate(zip(ran, expected, strict=True)) if a != b)
        findings.append(f"{at}: pass {k + 1} of the step was {ran[k]}, the proven order "
                        f"runs {expected[k]} there (ran: {' '.join(ran[max(0, k - 2):k + 3])}; "
                        f"proven: {' '.join(expected[max(0, k - 2):k + 3])})")
    findings.extend(_check_exchanges(at, step, program))
    return findings


def _check_exchanges(at: str, step: TraceStep, program: RankProgram) -> list[str]:
    findings: list[str] = []
    proven = [
        (sorted(map(str, op.sends)), sorted(map(str, op.recvs)))
        for op in program.ops if isinstance(op, Exchange) and (op.sends or op.recvs)
    ]
    known_sends = {t for sends, _ in proven for t in sends}
    known_recvs = {t for _, recvs in proven for t in recvs}
    ran = [(sorted(e["args"].get("sends", [])), sorted(e["args"].get("recvs", [])))
           for e in step.posts]
    waited: list[tuple[list[str], list[str]]] = [
        ([], sorted(e["args"].get("recvs", []))) for e in step.exchanges
        if e.get("name") == "wait"]
    for sends, recvs in ran + waited:
        for t in sends:
            if t not in known_sends:
                findings.append(f"{at}: sent {t}, a transfer the rank's program does not send")
        for t in recvs:
            if t not in known_recvs:
                findings.append(f"{at}: waited on {t}, a transfer the rank's program does "
                                "not receive")
    if findings:
        return findings
    if len(ran) != len(proven):
        findings.append(f"{at}: {len(ran)} exchanges ran, the program has {len(proven)}")
        return findings
    for k, (got, want) in enumerate(zip(ran, proven, strict=True)):
        if got != want:
            findings.append(f"{at}: exchange {k + 1} of the step posted sends {got[0]} and "
                            f"receives {got[1]}; the program's posts {want[0]} and {want[1]}")
            break
    return findings

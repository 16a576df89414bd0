"""Data dependencies: the per-device orders admit one global order that runs
every pass after the passes it needs.

The needs are `semantics.NEEDS` (§2 of the zero-bubble paper: F(j,s) after
F(j,s-1); B(j,s) (or BW(j,s)) after F(j,s) and after the backward of (j,s+1);
W(j,s) after B(j,s)). Together with "a device runs its passes in its order" they form a graph; a
global order exists exactly when that graph has no cycle. We find out by
running the orders (each device advances while its next pass's needs are done);
when devices get stuck, each stuck device waits for one unfinished pass on some
device, and following those waits from any stuck device ends in a cycle. Each
cycle is one error, with one note per wait.

Assumes the passes check passed (every pass exactly once, on its device).
"""

from __future__ import annotations

import numpy as np

from ppdsl.analysis.executor import needs_of, run_flat
from ppdsl.diagnostics import Diagnostic
from ppdsl.ir.flat import flatten
from ppdsl.ir.schedule import Pass, Schedule, format_pass
from ppdsl.semantics import NUM_KINDS

__all__ = ["check", "stuck_cycles"]


def _name(p: Pass) -> str:
    return format_pass(p, True)


def stuck_cycles(schedule: Schedule) -> list[list[tuple[int, int, int]]]:
    """The cycles of waits among stuck devices, each a list of
    (device, flat index of the pass it waits at, flat index of the pass it waits for).
    Empty when the orders run to the end."""
    flat = flatten(schedule)
    no_time = np.zeros((2 * NUM_KINDS, flat.num_stages))
    position = run_flat(flat, no_time, 0.0)[2]
    num_devices = schedule.num_devices
    waits: dict[int, tuple[int, int, int]] = {}  # device -> (head, needed, device of needed)
    for dev in range(num_devices):
        head = int(position[dev])
        if head >= flat.offsets[dev + 1]:
            continue
        for need in needs_of(flat, head):
            if need >= 0 and need >= position[flat.device[need]]:
                waits[dev] = (head, need, int(flat.device[need]))
                break
    cycles: list[list[tuple[int, int, int]]] = []
    state: dict[int, int] = {}  # 1: on the current walk, 2: finished
    for first in sorted(waits):
        walk: list[int] = []
        dev = first
        while dev not in state:
            state[dev] = 1
            walk.append(dev)
            dev = waits[dev][2]
        if state[dev] == 1:  # closed a new cycle
            cycle_devices = walk[walk.index(dev) :]
            cycles.append([(x, waits[x][0], waits[x][1]) for x in cycle_devices])
        for x in walk:
            state[x] = 2
    return cycles


def check(schedule: Schedule) -> list[Diagnostic]:
    """One error per cycle of waits, at the first waiting pass of the cycle,
    with one note per wait (and per 'runs later' order edge)."""
    flat = flatten(schedule)
    found: list[Diagnostic] = []
    for cycle in stuck_cycles(schedule):
        position = {dev: head for dev, head, _ in cycle}
        notes: list[tuple] = []
        for dev, head, need in cycle:
            p, q = flat.passes[head], flat.passes[need]
            other = int(flat.device[need])
            k_head = head - int(flat.offsets[dev])
            k_need = need - int(flat.offsets[other])
            if other == dev:
                notes.append(
                    (
                        p.span,
                        f"device {dev} runs {_name(p)} (pass {k_head}) before "
                        f"{_name(q)} (pass {k_need}), which it needs",
                    )
                )
                notes.append((q.span, f"{_name(q)} comes later in device {dev}'s order"))
            elif position[other] == need:
                notes.append(
                    (
                        p.span,
                        f"device {dev} waits at {_name(p)} (pass {k_head}) "
                        f"for {_name(q)} from device {other}",
                    )
                )
            else:
                blocker = flat.passes[position[other]]
                notes.append(
                    (
                        p.span,
                        f"device {dev} waits at {_name(p)} (pass {k_head}) "
                        f"for {_name(q)} from device {other}",
                    )
                )
                notes.append(
                    (
                        q.span,
                        f"device {other} runs {_name(q)} (pass {k_need}) only "
                        f"after {_name(blocker)}",
                    )
                )
        placement = schedule.placement
        if len(cycle) > 1 and placement.span is not None:
            notes.append((
                placement.span,
                f"the placement ({placement.kind}) puts the waiting passes' stages on devices "
                f"{', '.join(str(dev) for dev, _, _ in cycle)}",
            ))
        dev0, head0, _ = cycle[0]
        devices = ", ".join(str(dev) for dev, _, _ in cycle)
        what = (
            f"device {dev0}'s order runs a pass before one it needs"
            if len(cycle) == 1
            else f"devices {devices} wait on each other in a cycle"
        )
        found.append(
            Diagnostic(
                "error",
                f"the orders cannot run: {what}; no global order runs every pass after the "
                "passes it needs. Move one of these passes later (or its need earlier):",
                flat.passes[head0].span,
                tuple(notes),
            )
        )
    return found

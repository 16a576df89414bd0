"""Schedules built in Python for the runtime tests: a unit-time greedy list
scheduler gives valid orders for any placement (1F1B, GPipe, ZB-H1-like split,
V-shape). Used until/unless examples/*.pp compile; `example_cases` prefers those."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

from ppdsl.ir.schedule import Costs, MemoryModel, Pass, PassKind, Placement, Schedule

ROOT = Path(__file__).resolve().parents[2]


def greedy_schedule(
    name: str,
    stage_device: tuple[int, ...],
    num_microbatches: int,
    *,
    split: bool,
    cap: int | None,
    forward_first: bool = False,
    placement_kind: str = "parallel",
    mw: Fraction = Fraction(1, 2),
) -> Schedule:
    """Each device, each unit of time, runs its most urgent ready pass: a backward
    (oldest microbatch), else a forward while fewer than `cap` microbatches of that
    stage are in flight (F done, backward not finished), else a W."""
    num_stages = len(stage_device)
    num_devices = max(stage_device) + 1
    m = num_microbatches
    done: dict[tuple[PassKind, int, int], int] = {}
    orders: list[list[Pass]] = [[] for _ in range(num_devices)]
    bkind = PassKind.B if split else PassKind.BW
    todo = {(k, mb, s) for mb in range(m) for s in range(num_stages) for k in
            ((PassKind.F, PassKind.B, PassKind.W) if split else (PassKind.F, PassKind.BW))}
    t = 0
    while todo:
        chosen = []
        for dev in range(num_devices):
            stages = [s for s in range(num_stages) if stage_device[s] == dev]

            def ready(key: tuple[PassKind, int, int]) -> bool:
                k, mb, s = key
                if key not in todo:
                    return False
                deps = []
                if k is PassKind.F and s > 0:
                    deps.append((PassKind.F, mb, s - 1))
                if k is bkind:
                    deps.append((PassKind.F, mb, s))
                    if s < num_stages - 1:
                        deps.append((bkind, mb, s + 1))
                if k is PassKind.W:
                    deps.append((PassKind.B, mb, s))
                return all(d in done and done[d] < t for d in deps)  # noqa: B023

            def in_flight(s: int) -> int:
                last = PassKind.W if split else PassKind.BW
                return sum(1 for mb in range(m) if (PassKind.F, mb, s) in done
                           and (last, mb, s) not in done)

            backs = sorted((mb, -s) for s in stages for mb in range(m) if ready((bkind, mb, s)))
            fwds = sorted((mb, -s) for s in stages for mb in range(m) if ready((PassKind.F, mb, s))
                          and (cap is None or in_flight(s) < cap))
            ws = sorted((mb, s) for s in stages for mb in range(m) if ready((PassKind.W, mb, s)))
            pick = None
            if forward_first and fwds:
                pick = (PassKind.F, fwds[0][0], -fwds[0][1])
            elif backs:
                pick = (bkind, backs[0][0], -backs[0][1])
            elif fwds:
                pick = (PassKind.F, fwds[0][0], -fwds[0][1])
            elif ws:
                pick = (PassKind.W, ws[0][0], ws[0][1])
            if pick is not None:
                chosen.append((dev, pick))
        if not chosen and t > 10 * len(todo) + 100:
            raise RuntimeError(f"greedy schedule {name} stalled")
        for dev, pick in chosen:
            todo.discard(pick)
            done[pick] = t
            orders[dev].append(Pass(pick[0], pick[1], pick[2]))
        t += 1
    one = Fraction(1)
    return Schedule(
        name=name,
        file=f"<python:{name}>",
        params=(("d", num_devices), ("m", m)),
        num_microbatches=m,
        placement=Placement(placement_kind, num_devices, stage_device),
        split_backward=split,
        costs=Costs.unit(num_stages),
        memory=MemoryModel((one,) * num_stages, ((mw if split else one),) * num_stages),
        orders=tuple(tuple(o) for o in orders),
    )


def python_schedules(d: int, m: int) -> list[Schedule]:
    parallel = tuple(range(d))
    vshape = tuple(range(d)) + tuple(reversed(range(d)))
    looped = tuple(range(d)) * 2
    return [
        greedy_schedule("gpipe", parallel, m, split=False, cap=None, forward_first=True),
        greedy_schedule("one_f_one_b", parallel, m, split=False, cap=d),
        greedy_schedule("zb_h1_like", parallel, m, split=True, cap=d),
        greedy_schedule("v_shape", vshape, m, split=True, cap=d, placement_kind="vshape",
                        mw=Fraction(1)),
        greedy_schedule("interleaved", looped, m, split=False, cap=d, placement_kind="looped"),
    ]

"""The block form: `block period T { ... }`, the building block of the
controllable-memory paper (§3).

Each slot line gives, for microbatch 0, the start of a pass kind for every
chunk, for one chunk (`chunk 0:`) or for the chunks not given by number
(`chunk c:`); `W fill` leaves W to the greedy rule. A header `group G every U`
makes the block a grouped one: G microbatches a group, one every U, a group
every T (Megatron's microbatch groups of its interleaved 1F1B). A stage marked
`recompute` runs R: where no line places it, R ends as its backward (B or BW)
starts. The slot table is evaluated for every stage of every device and handed
to `ppdsl.frontend.blocks`, which repeats it m times into per-device orders.
"""

from __future__ import annotations

from fractions import Fraction

from ppdsl import limits
from ppdsl.frontend import ast
from ppdsl.frontend.blocks import repeat_block
from ppdsl.frontend.declarations import MAX_PASSES, Declarations, pass_kind
from ppdsl.frontend.expressions import (
    ElaborationError,
    Eval,
    Num,
    Scope,
    compile_expr,
    integer,
    norm,
    number,
    show,
)
from ppdsl.ir.schedule import Block, BlockSlot, Costs, PassOrder, Placement
from ppdsl.semantics import PassKind, pass_kinds

__all__ = ["elaborate_block"]


def elaborate_block(
    decl: ast.BlockDecl, state: Declarations, placement: Placement, m: int, costs: Costs
) -> tuple[Block, tuple[PassOrder, ...]]:
    """The block's slots for every stage (in the order the file wrote them) and
    the per-device orders of the block repeated m times."""
    period = number(state.evaluate(decl.period), decl.period.span, "the period")
    if period <= 0:
        raise ElaborationError(f"the block's period must be > 0, got {show(period)}", decl.period.span)
    group_size, spacing = _group(decl.group, state, m)
    split = state.split_backward
    w_fill = False
    max_chunks = max(len(placement.chunks(dev)) for dev in range(placement.num_devices))
    # (priority, chunk) -> kind -> (slot, compiled start, chunk var)
    numbered: dict[int, dict[str, tuple[ast.Slot, Eval]]] = {}
    named: dict[str, tuple[ast.Slot, Eval, str]] = {}
    general: dict[str, tuple[ast.Slot, Eval]] = {}
    base = Scope(["s", "i", "c"], state.scope())
    for line in decl.lines:
        if isinstance(line, ast.Fill):
            pass_kind(line.kind, line.span, split, state.recomputes)
            if line.kind != "W":
                raise ElaborationError(f"only W passes can be filled, not {line.kind}", line.span)
            if w_fill:
                raise ElaborationError("'W fill' is given twice", line.span)
            w_fill = True
            continue
        if isinstance(line.chunk, int):
            if not 0 <= line.chunk < max_chunks:
                raise ElaborationError(
                    f"chunk {line.chunk} out of range: devices hold {max_chunks} chunk(s), "
                    f"so 0..{max_chunks}",
                    line.span,
                    involves="place",
                )
            table: dict = numbered.setdefault(line.chunk, {})
            scope = base
        elif isinstance(line.chunk, str):
            table = named
            scope = Scope([line.chunk], base) if line.chunk not in base else base
        else:
            table = general
            scope = base
        for slot in line.slots:
            pass_kind(slot.kind, slot.span, split, state.recomputes)
            if slot.kind in table:
                other = table[slot.kind][0].span
                raise ElaborationError(
                    f"{slot.kind} is placed twice for the same chunks "
                    f"(also at {other.line}:{other.column})",
                    slot.span,
                )
            start = compile_expr(slot.start, scope)
            table[slot.kind] = (slot, start, line.chunk) if table is named else (slot, start)
    if w_fill and ("W" in general or "W" in named or any("W" in x for x in numbered.values())):
        raise ElaborationError("W is placed explicitly and by 'W fill'; keep one", decl.span)
    recompute = state.recompute or [False] * placement.num_stages
    used_r: set[int] = set()  # ids of the R slots some recomputed stage took
    slots: list[BlockSlot] = []
    env = dict(state.env)
    for device in range(placement.num_devices):
        for c, stage in enumerate(placement.chunks(device)):
            env["s"], env["i"], env["c"] = stage, device, c
            kinds = [
                k.value
                for k in pass_kinds(split, recompute[stage])
                if not (w_fill and k is PassKind.W)
            ]
            # R last: by default it ends as the backward starts
            kinds.sort(key=lambda k: k == "R")
            for kind in kinds:
                entry = numbered.get(c, {}).get(kind)
                if entry is None and kind in named:
                    slot, start, var = named[kind]
                    env[var] = c
                    entry = (slot, start)
                if entry is None:
                    entry = general.get(kind)
                if entry is None and kind == "R":
                    backward = next(x for x in reversed(slots) if x.kind in (PassKind.B, PassKind.BW))
                    duration = norm(Fraction(_stage_cost(state, kind, stage)))
                    slots.append(
                        BlockSlot(
                            PassKind.R,
                            stage,
                            device,
                            backward.start - Fraction(duration),
                            Fraction(duration),
                            backward.span,
                        )
                    )
                    continue
                if kind == "R" and entry is not None:
                    used_r.add(id(entry[0]))
                if entry is None:
                    raise ElaborationError(
                        f"the block places no {kind} for stage {stage} (chunk {c} of device "
                        f"{device}); add `{kind} at ...`" + (" or `W fill`" if kind == "W" else ""),
                        decl.span,
                    )
                slot, start = entry
                at = number(start(env), slot.start.span, "a start time")
                limits.check_integer(at, slot.start.span, f"stage {stage}'s start time")
                pk = PassKind(kind)
                duration = norm(Fraction(_stage_cost(state, kind, stage)))
                slots.append(
                    BlockSlot(pk, stage, device, Fraction(at), Fraction(duration), slot.span)
                )
    tables: list[dict] = [general, named, *numbered.values()]
    r_slots = [t["R"][0] for t in tables if "R" in t]
    for r_slot in r_slots:
        if id(r_slot) not in used_r:
            raise ElaborationError(
                "this R applies to no stage marked `recompute`: mark its stages "
                "(`recompute[s] = ...`) or remove it",
                r_slot.span,
            )
    # repeat_block breaks ties by slot position: keep the order the file wrote the slots
    slots.sort(key=lambda slot: (slot.span.sort_key() if slot.span else ("", 0, 0), slot.stage))
    block = Block(Fraction(period), tuple(slots), decl.span, group_size, Fraction(spacing))
    if len(slots) * m > MAX_PASSES:
        raise ElaborationError(
            f"the block repeated m = {m} times makes more than {MAX_PASSES} passes", decl.span
        )
    orders = repeat_block(
        block,
        placement,
        m,
        split_backward=split,
        w_fill=w_fill,
        costs=costs,
        recompute=frozenset(s for s, on in enumerate(recompute) if on),
    )
    return block, orders


def _group(group: ast.Group | None, state: Declarations, m: int) -> tuple[int, Num]:
    """The group size G and spacing U of `group G every U` (1 and 0 without one)."""
    if group is None:
        return 1, 0
    size = integer(state.evaluate(group.size), group.size.span, "the group size")
    if size <= 0:
        raise ElaborationError(f"the group size must be > 0, got {size}", group.size.span)
    if m % size:
        raise ElaborationError(
            f"the group size {size} does not divide m = {m}: every group holds {size} "
            f"microbatches; make m a multiple of {size} or pick a divisor of m",
            group.size.span,
        )
    spacing = number(state.evaluate(group.spacing), group.spacing.span, "the group spacing")
    if spacing <= 0:
        raise ElaborationError(
            f"the spacing of a group's microbatches must be > 0, got {show(spacing)}",
            group.spacing.span,
        )
    return size, spacing


def _stage_cost(state: Declarations, kind: str, stage: int) -> Num:
    return state.costs[PassKind(kind)][stage]

"""torch.distributed.pipelining's per-rank action lists, as CSV, both ways.

The format (torch's `_PipelineSchedule._dump_csv` / `_load_csv`, compute-only
form): one CSV row per rank, in rank order; each cell one action written
`<stage><letter><microbatch>`: `F` forward, `I` input-gradient backward (our
B), `W` weight-gradient backward, `B` full backward (our BW), e.g. `0F1`,
`3I0`. An empty cell is an idle step and is skipped. torch's DualPipeV writes
two overlapped actions as one cell `(0F3;7B1)OVERLAP_F_B`; we read it as an
overlapped pair (`F(..) & B(..)`) and write pairs that way. A schedule that mixes full backwards with I/W
(DualPipeV again) is read as a split one: each full backward becomes I then W.
torch's compute_comms form (what `_PipelineScheduleRuntime._dump_csv` writes by
default) is read too: `from_torch_csv` keeps its compute order (ppdsl lowers its
own transfers), and `torch_comm_items` reads its SEND_F, RECV_F, SEND_B, RECV_B
and FSDP actions (UNSHARD, RESHARD, REDUCE_GRAD), and groups of transfers posted
together written `(a;b;...)BATCH_P2P`, as the program torch runs, for the
deadlock check under a backend's rules (`ppdsl.analysis.comm_rules`). Rows may differ in length; torch writes them with
Python's csv module (CRLF line ends), and so do we.

`from_torch_csv` rebuilds a Schedule: ranks = rows, the stage -> rank map from
where each stage's actions sit (as torch's `_validate_schedule` infers it), or
checked against a placement the caller names; every bad cell is a located
error `file:line:col`. `to_pp` writes a Schedule as an order-form `.pp` file
(docs/language.md) that `ppdsl check` accepts.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Sequence
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

from ppdsl import limits
from ppdsl.analysis import comm_rules
from ppdsl.analysis.memory import peak_memory
from ppdsl.diagnostics import CompileError, Diagnostic, Span
from ppdsl.frontend import ast
from ppdsl.frontend.parse import parse_expression
from ppdsl.ir.schedule import (
    Costs,
    MemoryModel,
    Pass,
    PassKind,
    Placement,
    Schedule,
    torch_actions,
)
from ppdsl.semantics import DEFAULT_KEPT_INPUT, parse_torch_action, read_placement

__all__ = [
    "torch_comm_items",
    "to_torch_actions",
    "to_torch_csv",
    "from_torch_csv",
    "make_placement",
    "placement_text",
    "to_pp",
]

_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")
_BATCH = re.compile(r"\((.*)\)BATCH_P2P")
_TORCH_COMM = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B)(\d+)")
_TORCH_FSDP = re.compile(r"(\d+)(UNSHARD|RESHARD|REDUCE_GRAD)")
_TORCH_NON_COMPUTE = re.compile(r"\d*(UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)\d*")


def to_torch_actions(schedule: Schedule) -> list[list[str]]:
    """Per rank, the action strings of its order (`0F1`, `0I1`, `0W1`, `0B1`); an
    overlapped pair is torch's `(0F3;7I1)OVERLAP_F_B`."""
    rows = []
    for order in schedule.orders:
        actions = torch_actions(order)
        if order.overlapped is None:
            rows.append(actions)
            continue
        row: list[str] = []
        for action, overlapped in zip(actions, order.overlapped.tolist(), strict=True):
            if overlapped and row:
                row[-1] = f"({row[-1]};{action})OVERLAP_F_B"
            else:
                row.append(action)
        rows.append(row)
    return rows


def to_torch_csv(schedule: Schedule) -> str:
    """The compute-only CSV torch's `_load_csv` reads: one row per rank."""
    out = io.StringIO()
    writer = csv.writer(out)
    for row in to_torch_actions(schedule):
        writer.writerow(row)
    return out.getvalue()


def make_placement(kind: str, num_devices: int, num_stages: int | None = None) -> Placement:
    """A placement named as in the language: parallel, looped(v), vshape, wave(v)
    (`num_stages` gives v where the name leaves it out)."""
    name, v = read_placement(kind)
    if v is None and name in ("looped", "wave"):
        if num_stages is None or num_stages % num_devices:
            raise ValueError(f"{name} needs its chunk count: {name}(v)")
        v = num_stages // num_devices
    placement = Placement.named(name, num_devices, v)
    if name == "wave" and v == 2:  # wave(2) is the V-shape
        placement = Placement("vshape", num_devices, placement.stage_device)
    return placement


def placement_text(placement: Placement) -> str:
    """The `place` statement's argument that gives this exact stage -> device map."""
    return placement.spelling()


def _cells(line: str) -> list[tuple[int, str]]:
    """(1-based column, text) of each comma-separated cell; surrounding quotes and
    spaces are dropped (torch's cells never hold commas)."""
    cells = []
    column = 1
    for raw in line.split(","):
        text = raw.strip()
        lead = len(raw) - len(raw.lstrip())
        if len(text) >= 2 and text[0] == text[-1] == '"':
            text = text[1:-1].strip()
            lead += 1
        cells.append((column + lead, text))
        column += len(raw) + 1
    return cells


def _parse_cell(text: str, span: Span, found: list[Diagnostic]) -> list[tuple[PassKind, int, int]]:
    batch = _BATCH.fullmatch(text)
    if batch:  # a group of transfers posted together: no compute
        for part in (p.strip() for p in batch.group(1).split(";")):
            if not _TORCH_COMM.fullmatch(part):
                found.append(Diagnostic(
                    "error", f"bad part {part!r} of a BATCH_P2P cell: expected SEND_F, RECV_F, "
                    "SEND_B or RECV_B actions such as 0SEND_F1, separated by ';'", span))
        return []
    overlap = _OVERLAP.fullmatch(text)
    parts = [p.strip() for p in overlap.group(1).split(";")] if overlap else [text]
    actions = []
    for part in parts:
        try:
            action = parse_torch_action(part)
        except ValueError as e:
            found.append(Diagnostic("error", f"action {part!r}: {e}", span))
            continue
        if action is not None:
            actions.append(action)
            continue
        if _TORCH_NON_COMPUTE.fullmatch(part):
            # torch's compute_comms format: its own transfers and FSDP steps; ppdsl
            # inserts its transfers itself (lowering), so only the compute order counts
            continue
        hint = (
            "expected <stage><F|I|W|B><microbatch> such as 0F1 (F forward, I input "
            "gradient, W weight gradient, B full backward)"
        )
        found.append(Diagnostic("error", f"bad action {part!r}: {hint}", span))
    return actions


def from_torch_csv(
    text: str,
    file: str,
    *,
    placement: str | None = None,
    num_devices: int | None = None,
    num_microbatches: int | None = None,
    name: str | None = None,
) -> Schedule:
    """A Schedule from torch's compute-only CSV. `placement` (parallel,
    looped(v), vshape, wave(v)) is checked against where the actions sit;
    without it the stage -> rank map is inferred. `num_devices` defaults to the
    number of rows, `num_microbatches` to the largest microbatch + 1. Raises
    CompileError with every bad cell located."""
    found: list[Diagnostic] = []
    lines = text.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    rows: list[list[tuple[PassKind, int, int, Span]]] = []
    overlap_cells: set[Span] = set()  # torch's OVERLAP_F_B cells
    for line_no, line in enumerate(lines, start=1):
        row = []
        for column, cell in _cells(line):
            if not cell:
                continue  # an idle step
            span = Span(file, line_no, column, line_no, column + len(cell) - 1)
            if _OVERLAP.fullmatch(cell):
                overlap_cells.add(span)
            for kind, mb, stage in _parse_cell(cell, span, found):
                row.append((kind, mb, stage, span))
        rows.append(row)
    whole = Span(file, 1, 1, 1, 1)
    d = num_devices if num_devices is not None else len(rows)
    if not rows or not any(rows):
        found.append(
            Diagnostic("error", "no actions: expected one CSV row of actions per rank", whole)
        )
        raise CompileError(found)
    if len(rows) > d:
        found.append(
            Diagnostic(
                "error",
                f"{len(rows)} rows of actions but --devices {d}; give one row per rank",
                Span(file, d + 1, 1, d + 1, 1),
            )
        )
        raise CompileError(found)
    rows += [[] for _ in range(d - len(rows))]

    # The backward form: torch's full backward B, or I and W. A schedule that
    # mixes them (torch's DualPipeV) becomes a split one, each full backward an
    # I immediately followed by its W: the same work, the same memory freed.
    fused = any(a[0] is PassKind.BW for row in rows for a in row)
    split = any(a[0] in (PassKind.B, PassKind.W) for row in rows for a in row)
    if fused and split:
        rows = [
            [
                b
                for a in row
                for b in (
                    [(PassKind.B, *a[1:]), (PassKind.W, *a[1:])] if a[0] is PassKind.BW else [a]
                )
            ]
            for row in rows
        ]
        fused = False

    # the stage -> rank map
    num_stages = 1 + max(a[2] for row in rows for a in row)
    stage_rank: dict[int, tuple[int, Span]] = {}
    reported: set[tuple[int, int]] = set()
    for rank, row in enumerate(rows):
        for _kind, _mb, stage, span in row:
            if stage not in stage_rank:
                stage_rank[stage] = (rank, span)
            elif stage_rank[stage][0] != rank and placement is None:
                if (stage, rank) in reported:
                    continue
                reported.add((stage, rank))
                other, first = stage_rank[stage]
                found.append(
                    Diagnostic(
                        "error",
                        f"stage {stage} has actions on rank {rank} and on rank {other}; "
                        "a stage lives on one rank",
                        span,
                        ((first, f"stage {stage} on rank {other}"),),
                    )
                )
    if placement is not None:
        try:
            place = make_placement(placement, d, num_stages)
        except ValueError as exc:
            found.append(Diagnostic("error", str(exc), whole))
            raise CompileError(found) from None
        num_stages = place.num_stages
        # one error per (stage, rank) that disagrees, at its first action
        wrong: dict[tuple[int, int], list[Span]] = {}
        for rank, row in enumerate(rows):
            for _kind, _mb, stage, span in row:
                if stage >= num_stages or place.stage_device[stage] != rank:
                    wrong.setdefault((stage, rank), []).append(span)
        for (stage, rank), spans in wrong.items():
            count = f"{len(spans)} action{'s' if len(spans) != 1 else ''}, the first here"
            if stage >= num_stages:
                message = (
                    f"stage {stage} is out of range: placement {placement} on {d} devices has "
                    f"{num_stages} stages ({count})"
                )
            else:
                message = (
                    f"stage {stage} runs on rank {rank} ({count}), but placement {placement} "
                    f"puts it on rank {place.stage_device[stage]}"
                )
            found.append(Diagnostic("error", message, spans[0]))
    else:
        absent = [s for s in range(num_stages) if s not in stage_rank]
        if absent:
            found.append(
                Diagnostic(
                    "error",
                    f"stages {absent} have no actions, so their rank is unknown; "
                    "name the placement (--placement)",
                    whole,
                )
            )
        stage_device = tuple(stage_rank[s][0] if s in stage_rank else 0 for s in range(num_stages))
        place = Placement("list", d, stage_device)
        place = Placement(_kind_of(place), d, stage_device)
    if found:
        raise CompileError(found)

    m = num_microbatches if num_microbatches is not None else 1 + max(a[1] for r in rows for a in r)
    kinds = 2 if fused else 3
    redone = len({a[2] for r in rows for a in r if a[0] is PassKind.R})  # recomputed stages
    also = f" + R on {redone} recomputed stage{'s' if redone != 1 else ''}" if redone else ""
    limits.check_passes(
        num_stages * m * kinds + m * redone,
        whole,
        f"{num_stages} stages x {m} microbatches x {kinds} pass kinds{also}",
    )
    S = num_stages
    def overlapped(row: list, k: int) -> bool:
        # the backward of an OVERLAP_F_B cell, right after the cell's forward
        kind, _, _, span = row[k]
        return (span in overlap_cells and kind in (PassKind.B, PassKind.BW) and k > 0
                and row[k - 1][0] is PassKind.F and row[k - 1][3] == span)

    orders = tuple(
        tuple(
            Pass(kind, mb, stage, span, overlapped(row, k))
            for k, (kind, mb, stage, span) in enumerate(row)
        )
        for row in rows
    )
    # a stage with R actions is recomputed (ppdsl's own letter; torch has none)
    recomputed = {p.stage for order in orders for p in order if p.kind is PassKind.R}
    memory = MemoryModel.default(S)
    if recomputed:
        kept = Fraction(DEFAULT_KEPT_INPUT)
        memory = replace(
            memory, kept_input=tuple(kept if s in recomputed else None for s in range(S))
        )
    return Schedule(
        name=name or _identifier(Path(file).stem),
        file=file,
        params=(("d", d), ("m", m)),
        num_microbatches=m,
        placement=place,
        split_backward=not fused,
        costs=Costs.unit(S),
        memory=memory,
        orders=orders,
        span=whole,
    )


_COMM_TRANSFER = {  # action -> (sending, tensor, stage offset of the peer)
    "SEND_F": (True, "act", 1),
    "RECV_F": (False, "act", -1),
    "SEND_B": (True, "grad", -1),
    "RECV_B": (False, "grad", 1),
}


def torch_comm_items(text: str, schedule: Schedule) -> list[list[comm_rules.Item]] | None:
    """The compute+comm CSV's programs as `comm_rules` items (None when the CSV
    has no SEND/RECV action: a compute-only CSV): each cell one item, located
    at its row and column; a lone SEND/RECV one op, a `(a;b;...)BATCH_P2P`
    cell one group, UNSHARD/RESHARD/REDUCE_GRAD computations of their own
    (collectives of another process group); F takes the activation, I and B
    the gradient, each where it crosses ranks. `schedule` is the CSV read by
    `from_torch_csv` (its stage -> rank map). Raises CompileError, located, for
    a transfer between stages on one rank or a computation whose tensor the
    rank never receives."""
    file = schedule.file
    rank_of = schedule.placement.stage_device
    S = len(rank_of)
    found: list[Diagnostic] = []
    programs: list[list[comm_rules.Item]] = []
    any_comm = False
    lines = text.splitlines()
    for line_no, line in enumerate(lines[: schedule.num_devices], start=1):
        r = line_no - 1
        items: list[comm_rules.Item] = []
        for column, cell in _cells(line):
            if not cell:
                continue
            span = Span(file, line_no, column, line_no, column + len(cell) - 1)
            batch = _BATCH.fullmatch(cell)
            comm = [cell] if _TORCH_COMM.fullmatch(cell) else (
                [p.strip() for p in batch.group(1).split(";")] if batch else [])
            if comm:
                any_comm = True
                parts = []
                for action in comm:
                    parsed_comm = _TORCH_COMM.fullmatch(action)
                    if parsed_comm is None:
                        continue  # reported by from_torch_csv
                    stage_text, what, mb_text = parsed_comm.groups()
                    stage, mb = int(stage_text), int(mb_text)
                    sending, tensor, offset = _COMM_TRANSFER[what]
                    other = stage + offset
                    if not (0 <= stage < S and 0 <= other < S) or rank_of[other] == rank_of[stage]:
                        where = (f"stage {other} does not exist" if not 0 <= other < S
                                 else f"stage {other} is on the same rank")
                        found.append(Diagnostic(
                            "error", f"{action}: {where}, so there is nothing to "
                            f"{'send' if sending else 'receive'}", span))
                        continue
                    src, dst = (stage, other) if sending else (other, stage)
                    key = (tensor, mb, src, dst)
                    parts.append(comm_rules.Part(
                        sending, rank_of[other], key, f"{tensor}(mb {mb}, stage {src}->{dst})"))
                items.append(comm_rules.Item(cell, span, tuple(parts), group=bool(batch)))
                continue
            takes = []
            overlap = _OVERLAP.fullmatch(cell)
            for action in ([p.strip() for p in overlap.group(1).split(";")] if overlap else [cell]):
                try:
                    parsed = parse_torch_action(action)
                except ValueError:
                    parsed = None
                if parsed is None:
                    continue  # FSDP steps: a computation of another process group
                kind, mb, stage = parsed
                if kind is PassKind.F and stage > 0 and rank_of[stage - 1] != r:
                    takes.append(("act", mb, stage - 1, stage))
                if kind in (PassKind.B, PassKind.BW) and stage + 1 < S and rank_of[stage + 1] != r:
                    takes.append(("grad", mb, stage + 1, stage))
            items.append(comm_rules.Item(cell, span, takes=tuple(takes)))
        programs.append(items)
    if not any_comm:
        return None
    programs += [[] for _ in range(schedule.num_devices - len(programs))]
    for r, items in enumerate(programs):
        received = {p.transfer for item in items for p in item.parts if not p.sending}
        for item in items:
            for taken in item.takes:
                if taken not in received:
                    tensor, mb, src, dst = taken  # type: ignore[misc]
                    found.append(Diagnostic(
                        "error", f"{item.label} on rank {r} takes the {tensor} of microbatch {mb} "
                        f"from stage {src} on rank {rank_of[src]}, but rank {r} never receives "
                        f"it: add {dst}RECV_{'F' if tensor == 'act' else 'B'}{mb} before it",
                        item.span))
    if found:
        raise CompileError(found)
    return programs


def _kind_of(placement: Placement) -> str:
    text = placement_text(placement)
    return "list" if text.startswith("[") else text.split("(")[0]


def _identifier(stem: str) -> str:
    name = re.sub(r"\W", "_", stem)
    return name if name and not name[0].isdigit() else f"s_{name}"


def _device_order(order: Sequence[Pass], chunk_of: dict[int, int]) -> tuple[ast.OrderStmt, ...]:
    """A device's passes as pass calls: `F(j)` on chunk 0, `F(j, c)` on chunk c; an
    overlapped pair as `F(j, c) & B(k, c2)`."""
    calls: list[ast.OrderStmt] = []
    for p in order:
        c = chunk_of[p.stage]
        args = (ast.number(p.microbatch),) + ((ast.number(c),) if c else ())
        call = ast.PassCall(p.kind.value, args, ast.GENERATED)
        last = calls[-1] if calls else None
        if p.overlapped and isinstance(last, ast.PassCall):
            calls[-1] = ast.Overlap(last, call, ast.GENERATED)
        else:
            calls.append(call)
    return tuple(calls)


def to_pp(schedule: Schedule, source: str = "") -> str:
    """The schedule as an order-form `.pp` file: one `if i == k { ... }` block per
    device listing its passes (`F(j)` for chunk 0, `F(j, c)` for chunk c), and
    the order's own peak as its memory bound (the CSV carries none), so a later
    edit that raises it is caught."""
    s = schedule
    header = []
    if source:
        header.append(f"# imported from {source} (torch.distributed.pipelining action CSV)")
        header.append("# by `ppdsl import`: the order is written out for these d and m only")
    stmts: list[ast.Stmt] = [
        ast.Param("d", ast.number(s.num_devices), ast.GENERATED),
        ast.Param("m", ast.number(s.num_microbatches), ast.GENERATED),
        ast.place(s.placement.stage_device, s.num_devices, s.placement.lanes),
        ast.Backward("split" if s.split_backward else "fused", ast.GENERATED, ast.GENERATED),
    ]
    if s.recompute:
        marked = sorted(s.recompute)
        every = len(marked) == s.num_stages
        condition = " or ".join(f"s == {x}" for x in marked)
        stmts.append(
            ast.Recompute(
                None if every else "s",
                None if every else parse_expression(condition, "<import>"),
                ast.GENERATED,
            )
        )
    if not any(e.metric == "peak_memory" for e in s.expects):
        header.append(
            "# its memory bound is the imported order's own peak under the default "
            "M_B = 1, M_W = 1/2; edit as needed"
        )
        highest = max(peak_memory(s), default=Fraction(0))
        unit = s.memory.activation[0] if s.memory.activation else Fraction(0)
        stmts.append(ast.expect("peak_memory", "<=", ast.peak_bound(highest, unit)))
    branches = []
    for dev, order in enumerate(s.orders):
        chunk_of = {stage: c for c, stage in enumerate(s.placement.chunks(dev))}
        test = ast.binary("==", ast.name("i"), ast.number(dev))
        branches.append(ast.If(test, _device_order(order, chunk_of), (), ast.GENERATED))
    stmts.append(ast.OrderDecl(tuple(branches), ast.GENERATED))
    module = ast.Module(s.name, tuple(stmts), s.file, ast.GENERATED)
    return "".join(line + "\n" for line in header) + ast.format_module(module)

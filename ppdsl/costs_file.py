"""`--costs-from FILE`: a schedule's costs and memory model taken from another file,
typically what `ppdsl profile -o` measured on the user's model and hardware.

A costs file is a `.pp` file whose schedule holds only `cost` and `memory`
statements (per stage or not) and, optionally, `let profiled_stages = N`, the
stage count they were measured for:

    schedule profile {
        let profiled_stages = 2
        cost F[s] = s == 0 ? 1.315 : 1.6868
        ...
        memory M_W[s] = s == 0 ? 0.5554 : 0.5703
    }

`apply_costs` works on the parsed schedule, before elaboration: it drops the
schedule's own `cost` and `memory` statements and puts the file's in their place
(or right after `place`), so the schedule's lets and `expect` lines see the
measured values, and an error in a cost expression points at the costs file.
After elaboration, `check_stage_count` says so when the stage counts differ.

`schedule_with_costs` is what the compiler runs. A building block is a timing
design: its slots are laid out in the file's own cost units, so its collision
check and the per-device orders it yields (W fill included) come from the file
as written; the measured costs and memory model then time those orders and
bound their memory (the controllable-memory paper's squeeze: a block fixes the
order, execution runs it as early as it can). The file's `expect` lines were
written for its own costs and memory model (`M_B` is stage 0's, and measured
stages differ), so under measured ones a violation is a warning, not an error;
every other check (dependencies, collisions of the block as designed, deadlock)
is as strict as ever.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ppdsl.diagnostics import CompileError, Diagnostic, Span, register_source
from ppdsl.frontend import ast
from ppdsl.frontend.parse import parse
from ppdsl.ir.schedule import Costs, Expect, MemoryModel, Schedule

__all__ = [
    "CostsFile",
    "PROFILED_STAGES",
    "load_costs_file",
    "apply_costs",
    "check_stage_count",
    "evaluate_costs",
    "schedule_with_costs",
    "expectation_warnings",
]

PROFILED_STAGES = "profiled_stages"
"""The `let` naming the stage count a costs file was measured for."""


@dataclass(frozen=True)
class CostsFile:
    """The cost and memory statements of a costs file."""

    path: str
    statements: tuple[ast.Cost | ast.Memory, ...]
    num_stages: int | None
    """The stage count it was measured for (`let profiled_stages`), if it says."""
    stages_span: Span | None
    span: Span


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CompileError([Diagnostic("error", f"--costs-from: no such file: '{path}'")]) from None
    except IsADirectoryError:
        raise CompileError([Diagnostic("error", f"--costs-from: '{path}' is a directory")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CompileError([Diagnostic("error", f"--costs-from: cannot read '{path}': {exc}")]) from None


def load_costs_file(path: str | Path) -> CostsFile:
    """Parse a costs file; anything but cost, memory and `let profiled_stages = N`
    is an error at its line."""
    file = str(path)
    text = _read(file)
    if not text.strip():
        raise CompileError([Diagnostic(
            "error", "empty costs file: expected 'schedule NAME { cost ... }' "
            "(what `ppdsl profile -o` writes)", Span(file, 1, 1, 1, 1))])
    register_source(file, text)
    module = parse(text, file)
    statements: list[ast.Cost | ast.Memory] = []
    num_stages: int | None = None
    stages_span: Span | None = None
    errors: list[Diagnostic] = []
    for stmt in module.stmts:
        if isinstance(stmt, (ast.Cost, ast.Memory)):
            statements.append(stmt)
        elif isinstance(stmt, ast.Let) and stmt.name == PROFILED_STAGES:
            value = stmt.value
            if (
                not isinstance(value, ast.Number)
                or value.value.denominator != 1
                or value.value < 1
            ):
                errors.append(Diagnostic(
                    "error", f"'{PROFILED_STAGES}' must be a positive whole number", value.span))
            else:
                num_stages = int(value.value)
                stages_span = stmt.span
        else:
            errors.append(Diagnostic(
                "error",
                "a costs file holds only 'cost' and 'memory' statements (and "
                f"'let {PROFILED_STAGES} = N'); this one belongs in the schedule",
                getattr(stmt, "span", module.span),
            ))
    if errors:
        raise CompileError(errors)
    if not statements:
        raise CompileError([Diagnostic(
            "error", "the costs file has no 'cost' or 'memory' statement", module.span)])
    return CostsFile(file, tuple(statements), num_stages, stages_span, module.span)


def apply_costs(module: ast.Module, costs: CostsFile) -> ast.Module:
    """`module` with its cost and memory statements replaced by the costs file's:
    where its first cost or memory statement was, else right after `place`, else
    after its last `param`."""
    stmts = list(module.stmts)
    at = next((i for i, s in enumerate(stmts) if isinstance(s, (ast.Cost, ast.Memory))), None)
    if at is None:
        place = [i for i, s in enumerate(stmts) if isinstance(s, ast.Place)]
        params = [i for i, s in enumerate(stmts) if isinstance(s, ast.Param)]
        at = (place[0] if place else (params[-1] if params else -1)) + 1
    kept: list[ast.Stmt] = [s for s in stmts[:at] if not isinstance(s, (ast.Cost, ast.Memory))]
    kept += costs.statements
    kept += [s for s in stmts[at:] if not isinstance(s, (ast.Cost, ast.Memory))]
    return replace(module, stmts=tuple(kept))


def check_stage_count(schedule: Schedule, costs: CostsFile) -> None:
    """An error at `let profiled_stages` when the schedule has another stage count."""
    if costs.num_stages is None or costs.num_stages == schedule.num_stages:
        return
    placement = schedule.placement
    raise CompileError([Diagnostic(
        "error",
        f"these costs were measured for {costs.num_stages} stages, but schedule "
        f"'{schedule.name}' has {schedule.num_stages} (place {placement.kind}, "
        f"d={placement.num_devices}); profile with --stages {schedule.num_stages}",
        costs.stages_span,
    )])


def evaluate_costs(
    costs: CostsFile, num_devices: int, placement: str
) -> tuple[Costs, MemoryModel]:
    """The costs and memory model the file gives a schedule of `num_devices` devices
    under `placement` (the language's spelling: parallel, vshape, looped(2))."""
    from ppdsl.frontend.elaborate import elaborate

    file = f"<--costs-from {costs.path}>"
    text = (
        f"schedule costs {{\n    param d = {num_devices}\n    param m = 1\n"
        f"    place {placement}\n    backward split\n    order {{ }}\n}}\n"
    )
    register_source(file, text)
    module = apply_costs(parse(text, file), costs)
    schedule = elaborate(module, {})
    check_stage_count(schedule, costs)
    return schedule.costs, schedule.memory



def schedule_with_costs(
    module: ast.Module, overrides: dict[str, str], costs: CostsFile
) -> tuple[Schedule, tuple[Expect, ...]]:
    """(the schedule to compile, its expectations to report as warnings): orders
    as the file designs them; costs and memory model from the costs file."""
    from ppdsl.analysis.checks import collisions, lifespans
    from ppdsl.frontend.elaborate import elaborate

    designed = elaborate(module, overrides)
    measured = elaborate(apply_costs(module, costs), overrides)
    check_stage_count(measured, costs)
    if designed.block is not None:
        found = [
            d for d in collisions.check(designed) + lifespans.check(designed)
            if d.severity == "error"
        ]
        if found:
            raise CompileError(found)
    return replace(measured, orders=designed.orders, block=None, expects=()), measured.expects


def expectation_warnings(
    schedule: Schedule, timeline: object, expects: tuple[Expect, ...], costs: CostsFile
) -> tuple[Diagnostic, ...]:
    """The expectations violated under the measured costs and memory, as warnings."""
    from ppdsl.analysis.checks import expectations, memory

    with_expects = replace(schedule, expects=expects)
    found = memory.check(with_expects) + expectations.check(with_expects, timeline)  # type: ignore[arg-type]
    return tuple(
        replace(d, severity="warning",
                message=f"{d.message} (under the costs and memory from {costs.path}; the "
                "expectation was written for the file's own)")
        for d in found if d.severity == "error"
    )

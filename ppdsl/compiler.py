"""The compiler driver: a straight list of named passes.

    .pp text -> parse -> elaborate -> check -> lower -> early receives
             -> check deadlock -> simulate -> check reductions -> check expectations
             -> codegen

`compile_source` / `compile_file` run the passes up to the checked timeline and
return everything a command needs (the schedule IR, the rank programs, the
timeline and all warnings); they raise `CompileError` when the input is wrong,
carrying every finding of the pass that failed. `generate` is the last pass:
per-rank torch programs, a launcher and a manifest, as text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ppdsl import limits
from ppdsl.analysis import checks
from ppdsl.analysis.checks import deadlock, expectations, memory, reductions
from ppdsl.analysis.simulate import Timeline, simulate
from ppdsl.costs_file import CostsFile, expectation_warnings, schedule_with_costs
from ppdsl.diagnostics import CompileError, Diagnostic, Span, register_source
from ppdsl.frontend.ast import Module
from ppdsl.frontend.elaborate import elaborate
from ppdsl.frontend.parse import parse
from ppdsl.ir.rank import RankArrays, RankProgram
from ppdsl.ir.schedule import PassOrder, Schedule
from ppdsl.lowering.early_receives import pull_receives_forward
from ppdsl.lowering.lower import lower_arrays
from ppdsl.lowering.send_order import receives_in_send_order
from ppdsl.semantics import PassKind
from ppdsl.topology import Topology

if TYPE_CHECKING:
    from ppdsl.backend.codegen import GeneratedFiles

__all__ = [
    "Compiled",
    "compile_source",
    "compile_module",
    "compile_file",
    "compile_schedule",
    "compile_forward",
    "generate",
    "GeneratedFiles",
]


@dataclass(frozen=True)
class Compiled:
    """The result of compiling one schedule."""

    schedule: Schedule
    lowered: RankArrays
    """The rank programs as arrays (`programs` as objects)."""
    timeline: Timeline
    warnings: tuple[Diagnostic, ...]
    costs_from: str | None = None
    """The `--costs-from` file whose costs and memory model replaced the schedule's."""

    @property
    def programs(self) -> tuple[RankProgram, ...]:
        """The rank programs as objects (built on first use)."""
        return self.lowered.programs()


def _raise_errors(found: list[Diagnostic]) -> list[Diagnostic]:
    errors = [d for d in found if d.severity == "error"]
    if errors:
        raise CompileError(found)
    return found


def compile_schedule(
    schedule: Schedule,
    *,
    early_receives: bool = True,
    warn_unbounded: bool = True,
    phase: Callable[[str], None] = lambda name: None,
    comm_model: str = "rendezvous",
) -> Compiled:
    """The passes after elaboration, shared by `.pp` files and imported orders.

    Lowering posts each receive just before its consumer; where that makes
    blocking exchanges wait on each other, receives move into earlier exchanges
    (they hold their buffer longer). `early_receives=False` keeps the plain
    lowering (what a runtime that posts receives just in time would run), so its
    deadlocks are reported as cycles of waits. `warn_unbounded=False` drops the
    warning for a schedule with no `expect peak_memory` (for callers that write
    the bound themselves). `phase` is told each pass's name as it starts (the
    progress of a long compile). `comm_model` names the rules the deadlock check
    runs the programs under (`ppdsl.analysis.comm_rules`)."""
    phase("check")
    found = _raise_errors(checks.check_schedule(schedule, with_memory=False))
    # a broken memory bound is reported with every other broken expectation
    bounds = memory.check(schedule)
    phase("lower")
    programs = lower_arrays(schedule)
    if early_receives:
        phase("early receives")
        programs = pull_receives_forward(programs)
    if comm_model == "nccl":  # NCCL matches by order: receives as their peers send
        programs = receives_in_send_order(programs)
    phase("check deadlock")
    waits = deadlock.check(schedule, programs, comm_model=comm_model)
    if any(d.severity == "error" for d in waits):
        raise CompileError(found + bounds + waits)
    found += waits
    phase("simulate")
    timeline = simulate(schedule)
    phase("check reductions")
    found += _raise_errors(reductions.check(schedule, timeline))
    phase("check expectations")
    found = _raise_errors(found + bounds + expectations.check(schedule, timeline))
    if warn_unbounded:
        found += memory.missing_bound(schedule)
    return Compiled(schedule, programs, timeline, tuple(found))


def compile_forward(schedule: Schedule) -> RankArrays:
    """The evaluation programs of a schedule: each device's F passes in their
    order (no B, W or R), lowered with early receives and proven deadlock-free
    like any schedule (a deadlock raises CompileError with its cycle of waits)."""
    forward = replace(schedule, orders=tuple(
        PassOrder.of([p for p in order if p.kind is PassKind.F]) for order in schedule.orders
    ), expects=(), block=None)
    programs = pull_receives_forward(lower_arrays(forward))
    _raise_errors(deadlock.check(forward, programs))
    return programs


def compile_source(
    text: str,
    file: str,
    overrides: dict[str, str] | None = None,
    *,
    early_receives: bool = True,
    costs: CostsFile | None = None,
    comm_model: str = "rendezvous",
    topology: Topology | None = None,
    dp: int = 1,
) -> Compiled:
    """Compile `.pp` text. `overrides` are the command line's `-D name=value`;
    `costs` (`--costs-from`) replaces the file's cost and memory statements;
    `topology` (`--topology`) times its transfers over the links of `dp` replicas.
    Text past `limits`' source size is refused before parsing; a compile that runs
    long reports its phase on stderr (`limits.progress`)."""
    limits.check_source(len(text.encode("utf-8", "surrogatepass")), file)
    if text.startswith("\ufeff"):  # a UTF-8 byte order mark, as some editors write
        text = text[1:]
    register_source(file, text)
    with limits.using(limits.active()), limits.progress(file) as phase:  # loop count from 0
        module = parse(text, file)
        return compile_module(
            module, overrides, early_receives=early_receives, costs=costs, phase=phase,
            comm_model=comm_model, topology=topology, dp=dp,
        )


def compile_module(
    module: Module,
    overrides: dict[str, str] | None = None,
    *,
    early_receives: bool = True,
    costs: CostsFile | None = None,
    phase: Callable[[str], None] = lambda name: None,
    comm_model: str = "rendezvous",
    topology: Topology | None = None,
    dp: int = 1,
) -> Compiled:
    """The passes after parsing (`compile_source` without the text): what the
    fix search (`ppdsl.fixes`) runs on an edited AST before it proves a fix on
    the edited text."""
    phase("elaborate")
    if costs is None:
        schedule = _over_links(elaborate(module, overrides or {}), topology, dp)
        return compile_schedule(schedule, early_receives=early_receives, phase=phase,
                                comm_model=comm_model)
    schedule, expects = schedule_with_costs(module, overrides or {}, costs)
    schedule = _over_links(schedule, topology, dp)
    bounded = any(e.metric == "peak_memory" for e in expects)
    compiled = compile_schedule(
        schedule, early_receives=early_receives, warn_unbounded=not bounded, phase=phase,
        comm_model=comm_model,
    )
    late = expectation_warnings(compiled.schedule, compiled.timeline, expects, costs)
    return replace(compiled, costs_from=costs.path, warnings=compiled.warnings + late)


def _over_links(schedule: Schedule, topology: Topology | None, dp: int) -> Schedule:
    """The schedule's transfers (and reductions) timed over `topology`'s links
    (`ppdsl.topology`); itself without one. Ranks that do not fit its GPUs are an
    error at the schedule's name."""
    if topology is None:
        return schedule
    why = topology.check_fits(schedule.num_devices, dp)
    if why:
        raise CompileError([Diagnostic("error", why, schedule.span)])
    return topology.apply_to(schedule, dp)


def compile_file(
    path: str | Path,
    overrides: dict[str, str] | None = None,
    *,
    early_receives: bool = True,
    costs: CostsFile | None = None,
    comm_model: str = "rendezvous",
    topology: Topology | None = None,
    dp: int = 1,
) -> Compiled:
    """Compile a `.pp` file; a missing, unreadable, oversized or empty file is a
    located error."""
    path = Path(path)
    file = str(path)
    try:
        if path.is_file():  # a file past the source limit is refused before reading it
            limits.check_source(path.stat().st_size, file)
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CompileError([Diagnostic("error", f"no such file: '{file}'")]) from None
    except IsADirectoryError:
        raise CompileError([Diagnostic("error", f"'{file}' is a directory, not a .pp file")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CompileError([Diagnostic("error", f"cannot read '{file}': {exc}")]) from None
    if not text.strip():
        span = Span(file, 1, 1, 1, 1)
        raise CompileError(
            [Diagnostic("error", "empty file: expected 'schedule NAME { ... }'", span)]
        )
    return compile_source(text, file, overrides, early_receives=early_receives, costs=costs,
                          comm_model=comm_model, topology=topology, dp=dp)


def generate(compiled: Compiled, dp: int = 1, dp_mode: str = "replicate") -> GeneratedFiles:
    """Codegen, the last pass: one torch program per rank, the launcher and the
    manifest of a compiled schedule (`ppdsl.backend.codegen`, imported here:
    jinja2 is for the commands that write programs); `dp` data-parallel replicas
    in `dp_mode` by default."""
    from ppdsl.backend import codegen

    return codegen.generate(
        compiled.schedule, compiled.lowered, compiled.timeline, costs_from=compiled.costs_from,
        dp=dp, dp_mode=dp_mode,
    )


def __getattr__(name: str) -> Any:
    if name == "GeneratedFiles":
        from ppdsl.backend.codegen import GeneratedFiles

        return GeneratedFiles
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

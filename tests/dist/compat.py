"""Compile an example even where the blocking-exchange deadlock check rejects its
lowered programs: lower, then `ppdsl.checks.deadlock.pull_receives_forward` (helper
CHECKS' lowering aid, which moves receives earlier until the programs run under
blocking exchanges), then the deadlock check again. Used only until the compiler
applies it itself."""

from __future__ import annotations

from pathlib import Path

from ppdsl.compiler import Compiled, compile_file


def compile_pulled(path: Path, overrides: dict[str, str]) -> Compiled:
    from ppdsl import checks
    from ppdsl.checks import deadlock
    from ppdsl.diagnostics import CompileError
    from ppdsl.elaborate import elaborate
    from ppdsl.lower import lower
    from ppdsl.parse import parse
    from ppdsl.simulate import simulate

    try:
        return compile_file(path, overrides)
    except CompileError as err:
        if not any("deadlock" in d.message for d in err.diagnostics):
            raise
    schedule = elaborate(parse(path.read_text(), str(path)), overrides)
    found = checks.check_schedule(schedule)
    if any(d.severity == "error" for d in found):
        raise CompileError(found)
    programs = deadlock.pull_receives_forward(lower(schedule))
    still = [d for d in deadlock.check(schedule, programs) if d.severity == "error"]
    if still:
        raise CompileError(still)
    return Compiled(schedule, programs, simulate(schedule), tuple(found))

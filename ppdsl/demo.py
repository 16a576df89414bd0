"""`make demo`: compile examples/zb_v.pp (d=4, m=8) and train tiny_gpt (its
128-token variant) on a 4-process CPU pipeline (gloo on loopback), printing loss
per step and the predicted-vs-measured memory table."""

from __future__ import annotations

import sys
from pathlib import Path

from ppdsl.compiler import Compiled, compile_file
from ppdsl.diagnostics import CompileError, render_all

ROOT = Path(__file__).resolve().parent.parent


def compile_example(path: Path, overrides: dict[str, str]) -> Compiled:
    """compile_file; where the blocking-exchange deadlock check rejects the lowered
    programs, apply ppdsl.checks.deadlock.pull_receives_forward (receives posted
    earlier) and check again -- until the compiler does so itself."""
    try:
        return compile_file(path, overrides)
    except CompileError as err:
        if not any("deadlock" in d.message for d in err.diagnostics):
            raise
    from ppdsl import checks
    from ppdsl.checks import deadlock
    from ppdsl.elaborate import elaborate
    from ppdsl.lower import lower
    from ppdsl.parse import parse
    from ppdsl.simulate import simulate

    schedule = elaborate(parse(path.read_text(), str(path)), overrides)
    found = checks.check_schedule(schedule)
    programs = deadlock.pull_receives_forward(lower(schedule))
    errors = [d for d in found + deadlock.check(schedule, programs) if d.severity == "error"]
    if errors:
        raise CompileError(errors)
    return Compiled(schedule, programs, simulate(schedule), tuple(found))


def main(argv: list[str] | None = None) -> int:
    from ppdsl.commands.run import launch

    example = ROOT / "examples" / "zb_v.pp"
    model = ROOT / "examples" / "models" / "tiny_gpt.py"
    steps = (argv or [])[:1] or ["20"]
    print("ppdsl demo: examples/zb_v.pp -D d=4 -D m=8, tiny_gpt, 4 CPU ranks", flush=True)
    try:
        compiled = compile_example(example, {"d": "4", "m": "8"})
    except CompileError as err:
        print(render_all(err.diagnostics, sys.stderr), file=sys.stderr)
        return 1
    # stages_long: 128-token sequences with unfused attention, the zero-bubble paper's
    # memory regime (B frees most of a microbatch's activations).
    return launch(
        compiled, ["--model", f"{model}:stages_long", "--steps", steps[0], "--device", "cpu"]
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

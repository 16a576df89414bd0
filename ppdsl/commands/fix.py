"""Apply the compiler's proven fixes: the first fix of each error, again and
again, until the file is valid or no fix is left. Prints the diff; writes the
result to OUT (`-o`) or back to FILE. Exit 0 when the result is valid, 1 when
errors remain (printed), 2 on bad usage."""

from __future__ import annotations

import argparse
import difflib
import sys
import time
from pathlib import Path

from ppdsl.commands.common import (
    ExitCode,
    add_schedule_arguments,
    compile_from_args,
    costs_from_args,
    output_file,
    parse_defines,
    write_output,
)
from ppdsl.compiler import Compiled, compile_source
from ppdsl.diagnostics import CompileError, Diagnostic, render_all, source_text
from ppdsl.fixes import apply_fix, find_fixes

__all__ = ["HELP", "add_arguments", "run", "add_fix_arguments", "compile_with_fixes"]

HELP = "apply the compiler's proven fixes to a schedule file"

_MAX_ROUNDS = 10
"""How many fixes `ppdsl fix` applies at most (each round one, then recompiles)."""
_FIX_BUDGET_SECONDS = 5.0
"""The fix search's budget per round of `ppdsl fix` (check's is `fixes.BUDGET_SECONDS`)."""


def add_fix_arguments(parser: argparse.ArgumentParser) -> None:
    """`--no-fixes` (read by `compile_with_fixes`)."""
    parser.add_argument(
        "--no-fixes", action="store_true",
        help="do not look for proven fixes of the errors (the search adds at most 1 s)",
    )


def compile_with_fixes(args: argparse.Namespace) -> Compiled:
    """`compile_from_args`; a CompileError comes back with proven fixes attached
    to its errors, unless `--no-fixes`."""
    started = time.perf_counter()
    try:
        return compile_from_args(args)
    except CompileError as err:
        text = source_text(args.file)
        if getattr(args, "no_fixes", False) or text is None:
            raise
        found = find_fixes(
            err.diagnostics, text, args.file, parse_defines(args.defines),
            costs=costs_from_args(args), compile_seconds=time.perf_counter() - started,
            early_receives=not getattr(args, "no_early_receives", False),
            comm_model=getattr(args, "comm_model", "rendezvous"),
        )
        raise CompileError(found) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_schedule_arguments(parser)
    parser.add_argument(
        "-o", dest="output", metavar="OUT", default=None,
        help="write the fixed file here (default: FILE itself)",
    )


def _first_fix(diagnostics: list[Diagnostic]):
    return next((d.fixes[0] for d in diagnostics if d.severity == "error" and d.fixes), None)


def run(args: argparse.Namespace) -> ExitCode:
    path = Path(args.file)
    out = output_file(args.output or args.file)
    try:
        original = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CompileError([Diagnostic("error", f"no such file: '{args.file}'")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CompileError([Diagnostic("error", f"cannot read '{args.file}': {exc}")]) from None
    overrides = parse_defines(args.defines)
    costs = costs_from_args(args)
    text = original
    remaining: list[Diagnostic] = []
    applied: list[str] = []
    for _ in range(_MAX_ROUNDS + 1):
        try:
            compile_source(text, args.file, overrides, costs=costs)
            remaining = []
            break
        except CompileError as err:
            remaining = find_fixes(
                err.diagnostics, text, args.file, overrides, costs=costs,
                budget_seconds=_FIX_BUDGET_SECONDS,
            )
        fix = _first_fix(remaining)
        if fix is None or len(applied) == _MAX_ROUNDS:
            break
        applied.append(fix.description)
        text = apply_fix(text, fix)
    diff = difflib.unified_diff(
        original.splitlines(keepends=True), text.splitlines(keepends=True),
        fromfile=args.file, tofile=str(out),
    )
    sys.stdout.write("".join(diff))
    if text != original:
        write_output(out, text)
    for description in applied:
        print(f"{args.file}: applied: {description}", file=sys.stderr)
    if remaining:
        print(render_all(remaining, sys.stderr), file=sys.stderr)
        print(f"{args.file}: no proven fix left; {len(applied)} applied", file=sys.stderr)
        return ExitCode.INVALID
    print(f"{out}: ok ({len(applied)} fix{'es' if len(applied) != 1 else ''} applied)",
          file=sys.stderr)
    return ExitCode.OK

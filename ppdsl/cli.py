"""The `ppdsl` command line.

Each subcommand is one module in `ppdsl.commands` with `add_arguments(parser)`
and `run(args) -> ExitCode`. Exit codes (`ppdsl.commands.common.ExitCode`): 0
success, 1 invalid input (a located diagnostic was printed), 2 usage error, 3
internal error (a bug in ppdsl).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import sys
import traceback

from ppdsl import __version__, limits
from ppdsl.commands.common import ExitCode, UsageError, limits_from_args
from ppdsl.diagnostics import CompileError, render_all

__all__ = ["main", "ExitCode", "UsageError"]

# (subcommand, module in ppdsl.commands): the order is the order of `ppdsl --help`.
_COMMANDS = [
    ("check", "check"),
    ("fix", "fix"),
    ("show", "show"),
    ("stats", "stats"),
    ("compare", "compare"),
    ("compile", "compile"),
    ("run", "run"),
    ("profile", "profile"),
    ("trace", "trace"),
    ("search", "search"),
    ("plan", "plan"),
    ("bound", "bound"),
    ("export", "export"),
    ("import", "import_csv"),
]


def _build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or only of the one `argv` names (each
    command module imports what it runs: `check` needs neither the search nor
    torch, and a small `check` is over in less time than numba takes to import)."""
    parser = argparse.ArgumentParser(
        prog="ppdsl",
        description="Compile, check, show and run pipeline-parallel training schedules.",
    )
    parser.add_argument("--version", action="version", version=f"ppdsl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    args = sys.argv[1:] if argv is None else argv
    named = [c for c in _COMMANDS if args and c[0] == args[0]]
    for name, module_name in named or _COMMANDS:
        module = importlib.import_module(f"ppdsl.commands.{module_name}")
        p = sub.add_parser(name, help=module.HELP, description=module.__doc__)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    # a compiler run allocates a few objects per pass and frees little before it
    # ends: collecting the young generation every 700 allocations (the default)
    # cost a third of elaborating 400k passes
    gc.set_threshold(100_000, 50, 100)
    try:
        parser = _build_parser(argv)
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help is 0, bad usage is 2
        return int(exc.code or ExitCode.OK)
    try:
        with limits.using(limits_from_args(args)):
            return int(ExitCode(args._run(args)))
    except CompileError as err:
        print(render_all(err.diagnostics, sys.stderr), file=sys.stderr)
        return ExitCode.INVALID
    except UsageError as err:
        print(f"ppdsl {args.command}: error: {err}", file=sys.stderr)
        return ExitCode.USAGE
    except KeyboardInterrupt:
        print("ppdsl: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except BrokenPipeError:
        return ExitCode.OK
    except Exception:
        traceback.print_exc()
        print(
            f"ppdsl: internal error (a bug in ppdsl {__version__}, not in your input); "
            "please report it with the traceback above and the command you ran",
            file=sys.stderr,
        )
        return ExitCode.INTERNAL


if __name__ == "__main__":
    sys.exit(main())

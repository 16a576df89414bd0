"""The `ppdsl` command line.

Each subcommand is one module in `ppdsl.commands` with `add_arguments(parser)`
and `run(args) -> ExitCode`. Exit codes (`ppdsl.commands.common.ExitCode`): 0
success, 1 invalid input (a located diagnostic was printed), 2 usage error, 3
internal error (a bug in ppdsl).
"""

from __future__ import annotations

import argparse
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
    ("show", "show"),
    ("stats", "stats"),
    ("compare", "compare"),
    ("compile", "compile"),
    ("run", "run"),
    ("profile", "profile"),
    ("search", "search"),
    ("bound", "bound"),
    ("export", "export"),
    ("import", "import_csv"),
]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ppdsl",
        description="Compile, check, show and run pipeline-parallel training schedules.",
    )
    parser.add_argument("--version", action="version", version=f"ppdsl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module_name in _COMMANDS:
        module = importlib.import_module(f"ppdsl.commands.{module_name}")
        p = sub.add_parser(name, help=module.HELP, description=module.__doc__)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    try:
        parser = _build_parser()
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

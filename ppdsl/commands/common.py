"""What several subcommands share: exit codes, the usage error, the schedule
file argument and `-D` overrides."""

from __future__ import annotations

import argparse
from enum import IntEnum

from ppdsl.compiler import Compiled, compile_file
from ppdsl.costs_file import CostsFile, load_costs_file
from ppdsl.diagnostics import CompileError, Diagnostic

__all__ = [
    "ExitCode",
    "UsageError",
    "add_schedule_arguments",
    "add_defines_argument",
    "add_costs_from_argument",
    "parse_defines",
    "compile_from_args",
    "costs_from_args",
]


class ExitCode(IntEnum):
    """What `ppdsl` exits with; every command returns one (or raises, and the
    CLI maps the exception to one)."""

    OK = 0
    """Done; the schedule is valid."""
    INVALID = 1
    """Invalid input (a located diagnostic was printed), or the work it asked for
    failed (the ranks of `ppdsl run`)."""
    USAGE = 2
    """Bad command-line use (argparse's, or a `UsageError`)."""
    INTERNAL = 3
    """A bug in ppdsl (the traceback was printed)."""
    INTERRUPTED = 130
    """Stopped with Ctrl-C."""


class UsageError(Exception):
    """Bad command-line use that argparse cannot see: the CLI prints
    `ppdsl COMMAND: error: ...` and exits `ExitCode.USAGE`."""


def add_schedule_arguments(parser: argparse.ArgumentParser) -> None:
    """FILE, repeated `-D name=value` and `--costs-from`."""
    parser.add_argument("file", metavar="FILE", help="the .pp schedule file")
    add_defines_argument(parser, "override a parameter's default")
    add_costs_from_argument(parser)


def add_dp_arguments(parser: argparse.ArgumentParser) -> None:
    """`--dp N` and `--dp-mode replicate|shard` (data parallel x pipeline)."""
    parser.add_argument(
        "--dp", type=int, default=1, metavar="N",
        help="data-parallel replicas of the pipeline (world = N x pipeline ranks; global "
        "rank = replica * pipeline ranks + pipeline rank; default 1)",
    )
    parser.add_argument(
        "--dp-mode", choices=["replicate", "shard"], default="replicate",
        help="replicate (default): all-reduce each stage's gradients after its last W; "
        "shard: FSDP2 per stage, gathered once per step, reduce-scattered after its last W",
    )


def check_dp_arguments(args: argparse.Namespace) -> None:
    """A usage error for a bad `--dp`."""
    if args.dp < 1:
        raise UsageError(f"--dp must be at least 1, not {args.dp}")


def add_costs_from_argument(parser: argparse.ArgumentParser) -> None:
    """`--costs-from COSTS.pp` (read by `costs_from_args`)."""
    parser.add_argument(
        "--costs-from", metavar="COSTS.pp", default=None,
        help="take the costs and memory model from this file (what `ppdsl profile -o` "
        "writes) instead of the schedule's own; the schedule's expectations become warnings",
    )


def add_defines_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """Repeated `-D name=value` (parsed by `parse_defines`)."""
    parser.add_argument(
        "-D",
        dest="defines",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help=f"{what} (repeatable), e.g. -D d=8 -D m=32",
    )


def parse_defines(defines: list[str]) -> dict[str, str]:
    """`["d=8", "m=32"]` -> `{"d": "8", "m": "32"}`; malformed ones are errors."""
    found: dict[str, str] = {}
    errors: list[Diagnostic] = []
    for item in defines:
        name, eq, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not eq or not name or not value:
            errors.append(
                Diagnostic("error", f"-D {item!r}: expected NAME=VALUE, e.g. -D d=8")
            )
        elif name in found:
            errors.append(Diagnostic("error", f"-D {name} given twice ({found[name]!r} and {value!r})"))
        else:
            found[name] = value
    if errors:
        raise CompileError(errors)
    return found


def costs_from_args(args: argparse.Namespace) -> CostsFile | None:
    """The `--costs-from` file, parsed (None without the option)."""
    path = getattr(args, "costs_from", None)
    return load_costs_file(path) if path else None


def compile_from_args(args: argparse.Namespace) -> Compiled:
    """Compile FILE with the -D overrides of the command line (and, where the
    command has them, `--no-early-receives` and `--costs-from`)."""
    early = not getattr(args, "no_early_receives", False)
    return compile_file(
        args.file, parse_defines(args.defines), early_receives=early, costs=costs_from_args(args)
    )

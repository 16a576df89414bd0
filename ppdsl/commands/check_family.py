"""`ppdsl check FILE --for d=2..16 --for m=d..4*d`: the family sweep's command
line (`ppdsl.families` does the work): its flags, its progress, its text and
`--json` reports."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from ppdsl import json_text
from ppdsl.commands.common import ExitCode, UsageError, costs_from_args, parse_defines
from ppdsl.diagnostics import CompileError, Diagnostic, render_all
from ppdsl.families import (
    MAX_ENUMERATED,
    FamilyFile,
    ParamRange,
    SweepResult,
    count_instances,
    format_params,
    instances,
    parse_ranges,
    progress_reporter,
    sweep,
    unknown_params,
)
from ppdsl.frontend import ast
from ppdsl.report import diagnostic_json

__all__ = ["add_arguments", "wanted", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`--for`, `--samples`, `--seed`."""
    group = parser.add_argument_group(
        "families", "check every instance of parameter ranges (docs/testing.md)"
    )
    group.add_argument(
        "--for", dest="ranges", action="append", default=[], metavar="NAME=LOW..HIGH",
        help="check every value of a param from LOW to HIGH, both included (repeatable; "
        "a range may use the names of earlier ones: --for d=2..16 --for m=d..4*d); "
        "NAME=A,B,C lists values",
    )
    group.add_argument(
        "--samples", type=int, default=None, metavar="N",
        help="check N instances drawn by hypothesis instead of all of them (seeded: "
        "--seed), the failure shrunk to its smallest parameters",
    )
    group.add_argument(
        "--jobs", type=int, default=1, metavar="N",
        help="check the instances in N processes (0: one per CPU; default 1); the result "
        "is the same, the first invalid instance in order",
    )
    group.add_argument(
        "--symbolic", action="store_true",
        help="first try to prove the file for the whole --for d range at once (a block: "
        "collisions, dependencies, peak memory bounds, every m; an order form: each pass "
        "once, dependencies, peak memory bounds, over the --for m range); where it cannot, "
        "say why and enumerate",
    )
    group.add_argument("--seed", type=int, default=0, metavar="S",
                       help="the seed of --samples (default 0)")


def wanted(args: argparse.Namespace) -> bool:
    """True when the command line asks for a family sweep."""
    return bool(args.ranges) or args.samples is not None


def _setup(args: argparse.Namespace) -> tuple[FamilyFile, tuple[ParamRange, ...]]:
    if not args.ranges:
        raise UsageError("--samples needs at least one --for range")
    if args.samples is not None and args.samples < 1:
        raise UsageError(f"--samples must be at least 1, not {args.samples}")
    if args.jobs < 0:
        raise UsageError(f"--jobs must be 0 (one per CPU) or more, not {args.jobs}")
    if args.samples is not None and importlib.util.find_spec("hypothesis") is None:
        raise UsageError("--samples draws with hypothesis: install it (pip install hypothesis)")
    if args.ir or args.programs:
        raise UsageError("--ir and --programs print one instance; drop --for, or use -D")
    try:
        ranges = parse_ranges(args.ranges)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    family = _family(args)
    problems = unknown_params(family, ranges)
    if problems:
        raise UsageError("; ".join(problems))
    try:
        total = count_instances(ranges)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if total > MAX_ENUMERATED and args.samples is None and not args.symbolic:
        raise UsageError(
            f"the ranges hold more than {MAX_ENUMERATED:,} instances; check a sample of "
            "them with --samples N (seeded, --seed S)"
        )
    return family, ranges


def _family(args: argparse.Namespace) -> FamilyFile:
    """The file, parsed once; one it cannot read is invalid input (exit 1), as for `check`."""
    try:
        return FamilyFile(args.file, parse_defines(args.defines),
                          early_receives=not args.no_early_receives,
                          costs=costs_from_args(args), comm_model=args.comm_model)
    except FileNotFoundError:
        raise CompileError([Diagnostic("error", f"no such file: '{args.file}'")]) from None
    except IsADirectoryError:
        message = f"'{args.file}' is a directory, not a .pp file"
        raise CompileError([Diagnostic("error", message)]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CompileError([Diagnostic("error", f"cannot read '{args.file}': {exc}")]) from None


def _map_checks(args: argparse.Namespace, family: FamilyFile):
    jobs = args.jobs if args.jobs > 0 else (os.cpu_count() or 1)
    return family.parallel(jobs) if jobs > 1 else None


def _reproduce(args: argparse.Namespace, params: dict[str, int]) -> str:
    fixed = " ".join(f"-D {d}" for d in args.defines)
    given = " ".join(f"-D {k}={v}" for k, v in params.items())
    return " ".join(x for x in ("ppdsl check", args.file, fixed, given) if x)


def _ranges_text(ranges: tuple[ParamRange, ...]) -> str:
    return ", ".join(f"{r.name}={r.text}" for r in ranges)


def run(args: argparse.Namespace) -> ExitCode:
    """Sweep the family; exit 0 when every instance is valid, 1 at the first invalid one."""
    family, ranges = _setup(args)
    if args.symbolic:
        proof = _symbolic(args, family, ranges)
        if proof is not None:
            return proof
    progress = progress_reporter(args.file)
    try:
        result = sweep(family.check, ranges, samples=args.samples, seed=args.seed,
                       progress=progress, map_checks=_map_checks(args, family))
    except ValueError as exc:  # a range's bound that is no integer at some instance
        raise UsageError(str(exc)) from None
    if args.json:
        json_text.dump(_json(args, ranges, result), sys.stdout.write, 2)
        sys.stdout.write("\n")
    else:
        _print(args, ranges, result)
    return ExitCode.OK if result.failure is None else ExitCode.INVALID


def _symbolic(
    args: argparse.Namespace, family: FamilyFile, ranges: tuple[ParamRange, ...]
) -> ExitCode | None:
    """The symbolic proof over the d range (a block's for every m, an order
    form's over the m range): its exit code when it decides (proven, or a
    counterexample shown on its instance), None to fall back to the enumeration."""
    from ppdsl.analysis.symbolic import prove_block
    from ppdsl.analysis.symbolic_order import prove_order

    by_name = {r.name: r for r in ranges}
    if "d" not in by_name or ranges[0].name != "d" or not by_name["d"].inclusive_range:
        raise UsageError("--symbolic needs the first range to be d: --for d=LOW..HIGH")
    d_values = by_name["d"].values({})
    if not d_values:
        raise UsageError(f"--for d={by_name['d'].text} is empty")
    low, high = min(d_values), max(d_values)
    schedule = _first_schedule(family, ranges)
    if schedule is None:
        print(f"{args.file}: not proven symbolically: none of the first instances compiles; "
              "enumerating instead", file=sys.stderr)
        return None
    is_order = any(isinstance(s, ast.OrderDecl) for s in family.module.stmts)
    if is_order:
        proof = prove_order(family.module, schedule, low, high, _m_range(by_name.get("m")))
    else:
        proof = prove_block(family.module, schedule, low, high)
    where = f"{low} <= d <= {high}"
    if proof.status == "proven":
        method = "CP-SAT"
        if is_order:
            allowed = f"every m with {proof.m_range}"
            method = "Fourier-Motzkin"
        else:
            requires = [ast.format_expr(s.cond) for s in family.module.stmts
                        if isinstance(s, ast.Require)]
            allowed = "every m the file allows" + (f" ({', '.join(requires)})" if requires else "")
        print(f"{args.file}: proven for {where} and {allowed}: "
              f"{', '.join(proof.proven)} ({method}, {proof.seconds:.1f} s)")
        print(f"{args.file}: not decided symbolically: {'; '.join(proof.not_decided)}; "
              "enumerate a range with --for to check them")
        return ExitCode.OK
    if proof.status == "counterexample" or (is_order and proof.counterexample):
        d, m = proof.counterexample["d"], proof.counterexample["m"]
        params = {"d": d}
        if not is_order and "m" in by_name:  # a block's collision is real for every larger m
            m_values = by_name["m"].values(params)
            m = max(m, min(m_values)) if m_values else m
        params["m"] = m
        outcome = family.check(params)
        if outcome.failed or proof.status == "counterexample":
            if outcome.diagnostics:
                print(render_all(outcome.diagnostics, sys.stderr), file=sys.stderr)
            confirmed = ("" if outcome.failed
                         else " (the instance itself compiles: report this as a bug)")
            print(f"{args.file}: counterexample at d={d} m={m}: {proof.reason}{confirmed}; "
                  f"reproduce with: {_reproduce(args, params)}", file=sys.stderr)
            return ExitCode.INVALID
    what = "outside what the symbolic check decides" if proof.status == "outside" \
        else "not proven symbolically"
    print(f"{args.file}: {what}: {proof.reason}; enumerating instead", file=sys.stderr)
    return None


def _first_schedule(family: FamilyFile, ranges: tuple[ParamRange, ...]):
    """The schedule of the first instance that elaborates (the proofs read its
    placement, memory model and params; an order form's also its orders, for
    a potential), or None among the first 100."""
    from ppdsl.frontend.elaborate import elaborate

    for n, params in enumerate(instances(ranges)):
        if n == 100:
            break
        try:
            return elaborate(family.module,
                             {**family.fixed, **{k: str(v) for k, v in params.items()}})
        except CompileError:
            continue
    return None


def _m_range(found: ParamRange | None) -> tuple[ast.Expr, ast.Expr] | None:
    """`--for m=LOW..HIGH`'s ends as expressions over d (None: no such range)."""
    if found is None or not found.inclusive_range:
        return None
    from ppdsl.frontend.parse import parse_expression

    low, high = found.text.split("..")
    return (parse_expression(low.strip(), "--for m"), parse_expression(high.strip(), "--for m"))


def _summary(result: SweepResult) -> str:
    how = ("every instance" if result.mode == "enumerate"
           else f"a sample (seed {result.seed}) of {result.total:,} instances")
    outside = f", {result.skipped:,} outside the file's requires" if result.skipped else ""
    return f"{how}: {result.checked:,} checked{outside}, {result.seconds:.1f} s"


def _print(args: argparse.Namespace, ranges: tuple[ParamRange, ...], result: SweepResult) -> None:
    failure = result.failure
    if failure is None:
        print(f"{args.file}: ok for {_ranges_text(ranges)}: {_summary(result)}")
        return
    print(render_all(failure.diagnostics, sys.stderr), file=sys.stderr)
    shrunk = (f", shrunk from {format_params(failure.found)}"
              if failure.found != failure.params else "")
    first = " (the first in order: every instance before it is valid)" \
        if result.mode == "enumerate" else ""
    print(f"{args.file}: invalid at {format_params(failure.params)}{first}{shrunk}; "
          f"reproduce with: {_reproduce(args, failure.params)}\n"
          f"{args.file}: {_summary(result)}", file=sys.stderr)


def _json(args: argparse.Namespace, ranges: tuple[ParamRange, ...], result: SweepResult) -> dict:
    failure = None
    if result.failure is not None:
        failure = {
            "params": result.failure.params,
            "found": result.failure.found,
            "reproduce": _reproduce(args, result.failure.params),
            "diagnostics": [diagnostic_json(d) for d in result.failure.diagnostics],
        }
    return {
        "valid": result.failure is None,
        "file": args.file,
        "ranges": {r.name: r.text for r in ranges},
        "mode": result.mode,
        "seed": result.seed,
        "instances": result.total,
        "checked": result.checked,
        "skipped": result.skipped,
        "seconds": round(result.seconds, 3),
        "failure": failure,
    }


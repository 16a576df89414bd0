"""Plan a pipeline for a transformers causal LM: profile each layer once, then
choose the cut and the schedule together under a memory budget, and write the
schedule as a .pp file that `ppdsl run` trains.

    ppdsl plan --model hf:DIR --devices 4 --microbatches 8 --memory 64MiB -o plan.pp

Candidates: each schedule of `--schedules` (the examples, at d and m) with the
equal cut, the balanced cut, and balanced cuts under tighter and tighter bounds
on each stage's M_B (what lets a schedule that holds more microbatches fit);
with `--search`, also what `ppdsl search` finds under the balanced cut's costs.
Each is compiled with its stages' summed per-layer costs (`--costs-from` of a
generated costs file): the simulated makespan is the predicted step time and
the compiler's peak per device, in bytes, the predicted activation memory. The
plan is the fastest candidate whose every device stays within `--memory`.

Profiled here (no `--gpu`), the budget is activation memory only:
parameters, gradients and optimizer state are not counted in it. With
`--gpu h100|h200|a100|FILE` the model is sized from its config.json alone under
fake tensors and `--memory` bounds the whole device (`commands.plan_real`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ppdsl._resources import schedules_dir
from ppdsl.commands.common import (
    ExitCode,
    UsageError,
    add_bytes_arguments,
    output_file,
    parse_bytes,
    write_output,
)
from ppdsl.diagnostics import CompileError

HELP = "profile a hf:DIR model and choose its cut and schedule under a memory budget"

SCHEDULES = ("1f1b", "zb_h1", "zb_h2", "zb_v", "v_half", "v_min", "v_zb", "interleaved_1f1b",
             "gpipe")
"""The example schedules tried by default (examples/NAME.pp)."""

SEARCH_EVALUATIONS = 2000
"""`--search`'s heuristic budget (ppdsl search --evaluations)."""

_EXAMPLES = schedules_dir()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="hf:DIR",
                        help="a transformers checkpoint folder (config.json, optional weights)")
    parser.add_argument("--devices", "-d", type=int, required=True, help="pipeline ranks")
    parser.add_argument("--microbatches", "-m", type=int, required=True, help="microbatches")
    parser.add_argument("--memory", required=True, metavar="BUDGET",
                        help="peak activation memory per device: bytes, or with a unit "
                        "(512MiB, 2GiB, 800MB)")
    parser.add_argument("--dp", type=int, default=1, metavar="N",
                        help="data-parallel replicas the run will use (default 1): the printed "
                        "command carries it; the plan is per replica")
    parser.add_argument("--seq-len", type=int, default=64, metavar="L",
                        help="tokens per sample (default 64)")
    parser.add_argument("--microbatch-size", type=int, default=2, metavar="B",
                        help="samples per microbatch (default 2: ppdsl run's default batch)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), metavar="A,B,...",
                        help="example schedules to try (default: " + ",".join(SCHEDULES) + ")")
    parser.add_argument("--search", action="store_true",
                        help="also try what `ppdsl search` finds under the balanced cut's costs")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs per layer (default 3)")
    parser.add_argument("--repeats", type=int, default=10,
                        help="timed runs per layer; the median is used (default 10)")
    parser.add_argument("--no-transfer", action="store_true",
                        help="skip measuring the transfer between stages (cost comm = 0)")
    parser.add_argument("-o", "--output", default=None, metavar="PLAN.pp",
                        help="the chosen schedule; its stage costs go to PLAN.costs.pp "
                        "(optional with --json)")
    add_real_size_arguments(parser)


def add_real_size_arguments(parser: argparse.ArgumentParser) -> None:
    """`--gpu` and what the whole-device byte model reads (`commands.plan_real`)."""
    parser.add_argument("--gpu", default=None, metavar="h100|h200|a100|FILE",
                        help="plan at real size for this device from config.json alone (fake "
                        "tensors, FLOPs over the device's peak); --memory is then the whole "
                        "device")
    parser.add_argument("--json", action="store_true",
                        help="with --gpu: print the plan and every rank's bytes by component")
    add_bytes_arguments(parser)
    parser.add_argument("--dp-mode", choices=["replicate", "shard"], default="replicate",
                        help="with --gpu: shard divides parameters, gradients and optimizer "
                        "state by --dp")


@dataclass(frozen=True)
class Candidate:
    """One (schedule, cut) compiled under its stages' costs."""

    schedule: str
    """The example's name, or `search`."""
    source: str
    """The .pp text."""
    cut: tuple[int, ...]
    rule: str
    """How the cut was chosen: equal, balanced, or balanced under a bound."""
    step_ms: float
    """The simulated makespan under the profiled costs (ms)."""
    peaks: tuple[int, ...]
    """Predicted peak activation bytes per device."""
    costs: str
    """The costs file's text."""

    def fits(self, budget: int) -> bool:
        """Every device within `budget` bytes."""
        return max(self.peaks) <= budget


def _evaluate(name: str, source: str, overrides: dict[str, str], costs_text: str,
              cut: tuple[int, ...], rule: str, unit_bytes: float) -> Candidate | None:
    from ppdsl.backend.plan import plan_from_schedule
    from ppdsl.compiler import compile_source
    from ppdsl.costs_file import load_costs_file

    with tempfile.TemporaryDirectory(prefix="ppdsl-plan-") as tmp:
        path = Path(tmp) / "costs.pp"
        path.write_text(costs_text)
        try:
            compiled = compile_source(source, f"{name}.pp", overrides, costs=load_costs_file(path))
        except CompileError:
            return None
    plan = plan_from_schedule(compiled.schedule, compiled.lowered, compiled.timeline)
    peaks = tuple(int(round(float(p) * unit_bytes)) for p in plan.predicted_peaks())
    return Candidate(name, source, cut, rule, float(compiled.timeline.makespan), peaks, costs_text)


def _stage_count(source: str, name: str, overrides: dict[str, str]) -> int | None:
    """The schedule's model stages at these parameters (None when it does not
    compile there, or runs two lanes)."""
    from ppdsl.compiler import compile_source

    try:
        compiled = compile_source(source, f"{name}.pp", overrides)
    except CompileError:
        return None
    placement = compiled.schedule.placement
    return None if placement.lanes != 1 else placement.num_model_stages


def _pin_parameters(source: str, devices: int, microbatches: int) -> str:
    """The example's text with `param d` and `param m` defaulting to the plan's."""
    source = re.sub(r"(?m)^(\s*param d\s*=\s*)[^\n]*$", rf"\g<1>{devices}", source, count=1)
    return re.sub(r"(?m)^(\s*param m\s*=\s*)[^\n]*$", rf"\g<1>{microbatches}", source, count=1)


def run(args: argparse.Namespace) -> ExitCode:
    if not args.model.startswith("hf:"):
        raise UsageError("--model must be hf:DIR (a transformers checkpoint folder)")
    for flag, value in (("--devices", args.devices), ("--microbatches", args.microbatches),
                        ("--dp", args.dp), ("--seq-len", args.seq_len),
                        ("--microbatch-size", args.microbatch_size), ("--repeats", args.repeats)):
        if value < 1:
            raise UsageError(f"{flag} {value}: need at least 1")
    budget = parse_bytes(args.memory)
    names = [n.strip() for n in args.schedules.split(",") if n.strip()]
    for n in names:
        if not (_EXAMPLES / f"{n}.pp").is_file():
            raise UsageError(f"--schedules: no example named {n!r} (examples/{n}.pp)")
    if args.gpu is not None:
        from ppdsl.commands.plan_real import run_real

        texts = {n: (_EXAMPLES / f"{n}.pp").read_text() for n in names}
        return run_real(args, texts, budget, _pin_parameters)
    if args.output is None or args.json:
        raise UsageError("-o PLAN.pp is needed (--json and an optional -o go with --gpu)")
    out = output_file(args.output)
    costs_out = out.with_name(out.stem + ".costs.pp")

    from ppdsl.runtime.measure.costs_pp import to_costs_pp
    from ppdsl.runtime.measure.cut import (
        balanced_cut,
        boundary_transfer_ms,
        describe,
        profile_folder,
        stage_profile,
        stage_timings,
    )
    from ppdsl.runtime.models.hf import equal_cut
    from ppdsl.runtime.models.model import ModelError
    from ppdsl.search.progress import ProgressBar

    overrides = {"d": str(args.devices), "m": str(args.microbatches)}
    sources = {n: (_EXAMPLES / f"{n}.pp").read_text() for n in names}
    stage_counts = {n: _stage_count(sources[n], n, overrides) for n in names}
    bar = ProgressBar(sys.stderr.isatty())
    try:
        layers = profile_folder(args.model[len("hf:"):], args.seq_len, args.microbatch_size,
                                warmup=args.warmup, repeats=args.repeats, progress=bar)
    except ModelError as exc:
        raise UsageError(str(exc)) from None
    finally:
        bar.close()
    transfer_ms = None if args.no_transfer else boundary_transfer_ms(layers)
    n = layers.num_layers
    command = "ppdsl " + " ".join(shlex.quote(a) for a in (getattr(args, "argv", None)
                                                             or sys.argv[1:]))

    def candidates_for(name: str, source: str, stages: int) -> list[Candidate]:
        cuts: dict[tuple[int, ...], str] = {}
        if stages > n:
            return []
        cuts.setdefault(equal_cut(n, stages), "equal")
        balanced = balanced_cut(layers, stages)
        cuts.setdefault(balanced, "balanced")
        largest = max(t.activation_bytes for t in stage_timings(layers, balanced))
        for share in (0.9, 0.8, 0.7, 0.6, 0.5):
            try:
                bounded = balanced_cut(layers, stages, [largest * share] * stages)
            except ModelError:
                break
            cuts.setdefault(bounded, f"balanced, stage M_B <= {share:.0%} of balanced's")
        found = []
        for cut, rule in cuts.items():
            profile = stage_profile(layers, cut, args.model, transfer_ms)
            text = to_costs_pp(profile, command)
            c = _evaluate(name, source, overrides, text, cut, rule, profile.memory_unit_bytes())
            if c is not None:
                found.append(c)
        return found

    candidates: list[Candidate] = []
    for name in names:
        count = stage_counts[name]
        if count is not None:
            candidates += candidates_for(name, sources[name], count)
    if args.search:
        candidates += _searched(args, layers, transfer_ms, budget, command)
    fitting = [c for c in candidates if c.fits(budget)]
    print(f"{'schedule':<18} {'cut':<28} {'step ms':>9} {'peak bytes':>12}  rule")
    for c in sorted(candidates, key=lambda c: (not c.fits(budget), c.step_ms)):
        print(f"{c.schedule:<18} {','.join(map(str, c.cut)):<28} {c.step_ms:9.3f} "
              f"{max(c.peaks):12d}  {c.rule}{'' if c.fits(budget) else ' (over budget)'}")
    if not fitting:
        raise UsageError(
            f"no candidate keeps every device within --memory {args.memory} ({budget} bytes); "
            f"the smallest peak is {min(max(c.peaks) for c in candidates)} bytes: raise the "
            "budget, or use more devices or fewer microbatches in flight")
    best = min(fitting, key=lambda c: c.step_ms)
    header = (f"# planned by {command}\n# cut {describe(best.cut, n)} ({best.rule}); predicted "
              f"step {best.step_ms:.3f} ms; peak activation per device "
              f"{', '.join(map(str, best.peaks))} bytes (budget {budget})\n")
    text = best.source if best.schedule == "search" else _pin_parameters(
        best.source, args.devices, args.microbatches)
    write_output(out, header + text)
    write_output(costs_out, f"# cut: {','.join(map(str, best.cut))}\n" + best.costs)
    run_line = (f"ppdsl run {out} --model {args.model} --cut {','.join(map(str, best.cut))} "
                f"--seq-len {args.seq_len} --costs-from {costs_out}"
                + (f" --dp {args.dp}" if args.dp > 1 else "")
                + f" --batch-size {args.microbatch_size * args.microbatches * args.dp}")
    print(f"\nplan: {best.schedule}, cut {describe(best.cut, n)} ({best.rule})")
    print(f"  predicted step time {best.step_ms:.3f} ms (simulated under the profiled costs)")
    for rank, peak in enumerate(best.peaks):
        print(f"  device {rank}: predicted peak activation {peak} bytes")
    print(f"wrote {out} and {costs_out}; train with:\n  {run_line}")
    return ExitCode.OK


def _searched(args: argparse.Namespace, layers, transfer_ms: float | None, budget: int,
              command: str) -> list[Candidate]:
    """What `ppdsl search` finds (parallel placement) under the balanced cut's
    costs and the budget, compiled back under those costs."""
    from ppdsl.commands import search as search_command
    from ppdsl.runtime.measure.costs_pp import to_costs_pp
    from ppdsl.runtime.measure.cut import balanced_cut, stage_profile

    cut = balanced_cut(layers, args.devices)
    profile = stage_profile(layers, cut, args.model, transfer_ms)
    text = to_costs_pp(profile, command)
    unit = profile.memory_unit_bytes()
    # search's budget is in 1F1B stages: the model's activation is d of them
    stage_units = sum(s.timing.activation_bytes for s in profile.stages) / args.devices
    with tempfile.TemporaryDirectory(prefix="ppdsl-plan-") as tmp:
        costs, found = Path(tmp) / "costs.pp", Path(tmp) / "searched.pp"
        costs.write_text(text)
        parser = argparse.ArgumentParser(prog="ppdsl search")
        search_command.add_arguments(parser)
        options = parser.parse_args([
            "--devices", str(args.devices), "--microbatches", str(args.microbatches),
            "--memory", f"{budget / stage_units:.6f}", "--costs-from", str(costs),
            "--objective", "makespan", "--evaluations", str(SEARCH_EVALUATIONS),
            "-o", str(found)])
        try:
            with contextlib.redirect_stdout(io.StringIO()), \
                    contextlib.redirect_stderr(io.StringIO()):
                code = search_command.run(options)
        except (UsageError, CompileError):  # nothing found within the budget
            return []
        if code != ExitCode.OK or not found.is_file():
            return []
        source = found.read_text()
    c = _evaluate("search", source, {}, text, cut, "balanced (ppdsl search)", unit)
    return [c] if c is not None else []

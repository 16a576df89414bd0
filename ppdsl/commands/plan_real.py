"""`ppdsl plan --gpu h100|h200|a100|FILE`: plan a causal LM at real size from
its `config.json` alone, on a machine without the GPU.

The model's layers are sized under fake tensors (`runtime.measure.fake`): their
parameters, what each keeps for its backward, each pass's working memory and
FLOPs. Pass times are FLOPs over the device spec. Each candidate (schedule ×
cut, as `ppdsl plan` builds them) is compiled under those costs, and each rank's
whole-device bytes are added up over its program (`analysis.device_bytes`):
`--memory` bounds the whole device. The fastest candidate whose every rank fits
is the plan; `--json` prints every rank's bytes by component.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ppdsl import json_text
from ppdsl.analysis.checks import reductions
from ppdsl.analysis.device_bytes import (
    DeviceOptions,
    ModelBytes,
    RankBytes,
    StageBytes,
    device_bytes,
    format_bytes,
)
from ppdsl.analysis.simulate import simulate
from ppdsl.commands.common import ExitCode, UsageError, device_options, output_file, write_output
from ppdsl.compiler import Compiled, compile_module
from ppdsl.costs_file import CostsFile, load_costs_file, schedule_with_costs
from ppdsl.diagnostics import CompileError
from ppdsl.frontend.ast import Module
from ppdsl.frontend.elaborate import elaborate
from ppdsl.frontend.parse import parse
from ppdsl.ir.schedule import PassKind, Schedule

__all__ = ["run_real"]

TOKEN_BYTES = 8
"""Bytes of one token id or target (int64, what the data loader yields)."""


@dataclass(frozen=True)
class _Candidate:
    schedule: str
    source: str
    cut: tuple[int, ...]
    rule: str
    step_ms: float
    ranks: tuple[RankBytes, ...]
    costs: str

    @property
    def peak(self) -> int:
        return max(r.peak_bytes for r in self.ranks)


def _model_bytes(size: Any, cut: tuple[int, ...], unit_bytes: float,
                 microbatches: int) -> ModelBytes:
    """The byte model's view of `size` (a `ModelSize`) cut at `cut`: a stage's
    parameters and stash gradients are its layers' sums, its working memory
    the largest of one layer's (layers run one after another)."""
    n = size.num_layers
    bounds = list(cut) + [n]
    stages = []
    for s in range(len(cut)):
        # profile index: 0 is the embedding, 1 + i decoder layer i, n + 1 the head
        members = list(range(1 + bounds[s], 1 + bounds[s + 1]))
        if s == 0:
            members = [0] + members
        if s == len(cut) - 1:
            members.append(n + 1)
        layers = [size.layers[i] for i in members]
        working = {kind: max(x.working[kind.value] for x in layers)
                   for kind in (PassKind.F, PassKind.B, PassKind.W, PassKind.BW, PassKind.R)}
        stages.append(StageBytes(sum(x.parameters for x in layers),
                                 0 if s == len(cut) - 1 else layers[-1].output_bytes,
                                 sum(x.stash_bytes for x in layers), working))
    batch = microbatches * size.microbatch_size * size.seq_len * TOKEN_BYTES
    return ModelBytes(tuple(stages), unit_bytes, batch, batch)


def _costs(costs: str) -> CostsFile:
    with tempfile.TemporaryDirectory(prefix="ppdsl-plan-") as tmp:
        path = Path(tmp) / "costs.pp"
        path.write_text(costs)
        return load_costs_file(path)


def _same_overlap(x: np.ndarray | None, y: np.ndarray | None) -> bool:
    return x is None and y is None or x is not None and y is not None and np.array_equal(x, y)


def _same_orders(a: Schedule, b: Schedule) -> bool:
    return a.placement == b.placement and len(a.orders) == len(b.orders) and all(
        np.array_equal(x.kind, y.kind) and np.array_equal(x.microbatch, y.microbatch)
        and np.array_equal(x.stage, y.stage) and _same_overlap(x.overlapped, y.overlapped)
        for x, y in zip(a.orders, b.orders, strict=True))


def _compile(module: Module, overrides: dict[str, str], costs: str,
             proven: Compiled | None) -> Compiled | None:
    """The schedule under `costs`. A costs file changes the costs and memory
    model, never the orders (`costs_file.schedule_with_costs`), so the rank
    programs `proven` lowered and proved deadlock-free for the same orders under
    another cut are reused: only the time line is simulated again."""
    try:
        if proven is None:
            return compile_module(module, overrides, costs=_costs(costs))
        schedule, _ = schedule_with_costs(module, overrides, _costs(costs))
        if not _same_orders(schedule, proven.schedule):
            return compile_module(module, overrides, costs=_costs(costs))
        timeline = simulate(schedule)
        if any(d.severity == "error" for d in reductions.check(schedule, timeline)):
            return None
        return replace(proven, schedule=schedule, timeline=timeline)
    except CompileError:
        return None


def _model_stages(module: Module, overrides: dict[str, str]) -> int | None:
    """The schedule's model stages at these parameters, from its elaboration
    alone (None when it does not elaborate there, or runs two lanes)."""
    try:
        schedule = elaborate(module, overrides)
    except CompileError:
        return None
    placement = schedule.placement
    return None if placement.lanes != 1 else placement.num_model_stages


def run_real(args: argparse.Namespace, sources: dict[str, str], budget: int,
             pin: Callable[[str, int, int], str]) -> ExitCode:
    """`ppdsl plan --gpu`: `sources` are the candidate schedules' texts by name,
    `pin` sets a schedule text's d and m."""
    from ppdsl.runtime.measure.costs_pp import to_costs_pp
    from ppdsl.runtime.measure.cut import balanced_cut, describe, stage_profile
    from ppdsl.runtime.measure.fake import device_spec, model_size
    from ppdsl.runtime.models.hf import equal_cut
    from ppdsl.runtime.models.model import ModelError

    try:
        spec = device_spec(args.gpu)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    options = device_options(args)
    out = output_file(args.output) if args.output else None
    dtype = "bf16" if options.param_dtype == "bf16" or options.precision != "fp32" else "fp32"
    try:
        size = model_size(args.model[len("hf:"):], args.seq_len, args.microbatch_size, dtype)
    except ModelError as exc:
        raise UsageError(str(exc)) from None
    profile = size.profile(spec)
    transfer_ms = size.transfer_ms(spec)
    overrides = {"d": str(args.devices), "m": str(args.microbatches)}
    command = "ppdsl " + " ".join(getattr(args, "argv", None) or sys.argv[1:])
    candidates: list[_Candidate] = []
    for name, source in sources.items():
        try:
            module = parse(source, f"{name}.pp")
        except CompileError:
            continue
        stages = _model_stages(module, overrides)
        if stages is None or stages > size.num_layers:
            continue
        proven: Compiled | None = None
        cuts = {equal_cut(size.num_layers, stages): "equal"}
        cuts.setdefault(balanced_cut(profile, stages), "balanced")
        for cut, rule in cuts.items():
            stage_costs = stage_profile(profile, cut, args.model, transfer_ms, device=spec.name)
            costs = to_costs_pp(stage_costs, command)
            compiled = _compile(module, overrides, costs, proven)
            if compiled is None:
                continue
            proven = compiled
            model = _model_bytes(size, cut, stage_costs.memory_unit_bytes(), args.microbatches)
            ranks = device_bytes(compiled.schedule, compiled.lowered, model, options)
            candidates.append(_Candidate(name, source, cut, rule,
                                         float(compiled.timeline.makespan), ranks, costs))
    if not candidates:
        raise UsageError(f"no schedule of --schedules compiles at d={args.devices}, "
                         f"m={args.microbatches} with at most {size.num_layers} stages")
    fitting = [c for c in candidates if c.peak <= budget]
    # the fastest that fits; when none does, the one that comes closest
    best = (min(fitting, key=lambda c: (c.step_ms, c.peak)) if fitting
            else min(candidates, key=lambda c: (c.peak, c.step_ms)))
    if args.json:
        json_text.dump(_json(args, options, spec.name, size, best, candidates, budget,
                             bool(fitting)), sys.stdout.write, 2)
        sys.stdout.write("\n")
    else:
        _print(candidates, best, budget, size, describe)
    if not fitting:
        print(f"ppdsl plan: error: no candidate keeps every rank within --memory {args.memory} "
              f"({budget} bytes); the smallest peak is {min(c.peak for c in candidates)} bytes: "
              "use more devices, fewer microbatches in flight, --dp-mode shard or bf16",
              file=sys.stderr)
        return ExitCode.INVALID
    if out is not None:
        header = (f"# planned by {command}\n# cut {describe(best.cut, size.num_layers)} "
                  f"({best.rule}); predicted step {best.step_ms:.3f} ms on {spec.name}; "
                  f"peak bytes per rank {', '.join(str(r.peak_bytes) for r in best.ranks)} "
                  f"(budget {budget})\n")
        costs_out = out.with_name(out.stem + ".costs.pp")
        write_output(out, header + pin(best.source, args.devices, args.microbatches))
        write_output(costs_out, f"# cut: {','.join(map(str, best.cut))}\n" + best.costs)
        if not args.json:
            print(f"wrote {out} and {costs_out}")
    return ExitCode.OK


def _json(args: argparse.Namespace, options: DeviceOptions, gpu: str, size: Any,
          best: _Candidate, candidates: list[_Candidate], budget: int,
          fits: bool) -> dict[str, Any]:
    layer = size.layers[1]
    return {
        "model": args.model,
        "gpu": gpu,
        "param_dtype": options.param_dtype,
        "optimizer": options.optimizer,
        "precision": options.precision,
        "dp": options.dp,
        "dp_mode": options.dp_mode,
        "memory_budget": budget,
        "fits": fits,
        "schedule": best.schedule,
        "cut": list(best.cut),
        "rule": best.rule,
        "predicted_step_ms": best.step_ms,
        "allocator_reserve": options.reserve,
        "layer": {"parameters": layer.parameters, "activation_bytes": layer.activation_bytes,
                  "weight_bytes": layer.weight_bytes, "stash_bytes": layer.stash_bytes,
                  "flops": layer.flops},
        "ranks": [{"rank": r.rank, "peak_bytes": r.peak_bytes, "bytes": r.bytes,
                   "at_peak": r.at_peak} for r in best.ranks],
        "candidates": [{"schedule": c.schedule, "cut": list(c.cut), "rule": c.rule,
                        "step_ms": c.step_ms, "peak_bytes": c.peak,
                        "fits": c.peak <= budget} for c in candidates],
    }


def _print(candidates: list[_Candidate], best: _Candidate, budget: int, size: Any,
           describe: Any) -> None:
    print(f"{'schedule':<18} {'cut':<28} {'step ms':>10} {'peak':>12}  rule")
    for c in sorted(candidates, key=lambda c: (c.peak > budget, c.step_ms)):
        print(f"{c.schedule:<18} {','.join(map(str, c.cut)):<28} {c.step_ms:10.3f} "
              f"{format_bytes(c.peak):>12}  {c.rule}{'' if c.peak <= budget else ' (over budget)'}")
    print(f"\nplan: {best.schedule}, cut {describe(best.cut, size.num_layers)} ({best.rule}); "
          f"predicted step {best.step_ms:.3f} ms")
    from ppdsl.report import bytes_table

    sys.stdout.write(bytes_table(best.ranks, f"whole-device bytes per rank (budget "
                                             f"{format_bytes(budget)}):"))

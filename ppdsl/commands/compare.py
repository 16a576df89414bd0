"""Compare schedules side by side under the same `-D` values: makespan, bubble
ratio, idle fraction, peak activation memory and receive buffers, one row per
file. Makespan and peak memory are shown in each file's own units and in units
of one 1F1B stage: with v chunks per device a file's stages are 1/v of the
model's layers per device, so its pass costs and M_B (each per its own stage)
are scaled by 1/v, and a V-shape compares with a parallel placement of the same
model. Files that declare different costs or memory models are pointed out."""

from __future__ import annotations

import argparse
import json
import sys
from fractions import Fraction
from typing import Any

from ppdsl.commands.common import (
    ExitCode,
    add_costs_from_argument,
    add_defines_argument,
    add_limit_arguments,
    costs_from_args,
    parse_defines,
)
from ppdsl.compiler import Compiled, compile_file
from ppdsl.diagnostics import CompileError, Diagnostic, render_all
from ppdsl.semantics import format_short

HELP = "compare several schedules side by side (makespan, bubble, memory)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help="the .pp schedule files")
    add_defines_argument(parser, "override a parameter in every file")
    add_costs_from_argument(parser)
    add_limit_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print a machine-readable result")


def _costs_text(c: Compiled) -> str:
    costs = c.schedule.costs
    parts = []
    for name, values in (
        ("F", costs.forward),
        ("B", costs.backward_input),
        ("W", costs.backward_weight),
    ):
        distinct = sorted(set(values))
        parts.append(f"{name}={'/'.join(f'{float(x):g}' for x in distinct)}")
    return " ".join(parts) + f" comm={float(costs.comm):g}"


def _memory_text(c: Compiled) -> str:
    m = c.schedule.memory
    ratios = sorted({w / a for a, w in zip(m.activation, m.weight_retained, strict=True) if a})
    return "M_W/M_B=" + "/".join(str(r) for r in ratios)


def _row(file: str, c: Compiled) -> dict[str, Any]:
    s, t = c.schedule, c.timeline
    peak = max(t.peak_memory, default=Fraction(0))
    chunks = Fraction(s.num_stages, s.num_devices)
    return {
        "file": file,
        "name": s.name,
        "devices": s.num_devices,
        "stages": s.num_stages,
        "microbatches": s.num_microbatches,
        "placement": s.placement.kind,
        "backward": "split" if s.split_backward else "fused",
        "makespan": float(t.makespan),
        "makespan_in_1f1b_stages": float(t.makespan / chunks),
        "bubble_ratio": float(t.bubble_ratio),
        "idle_fraction": float(t.idle_fraction),
        "peak_memory": peak,
        "peak_memory_per_1f1b_stage": peak / chunks,
        "receive_buffers_peak": max(
            c.lowered.receive_buffers_peaks(), default=0
        ),
        "costs": _costs_text(c),
        "memory_model": _memory_text(c),
    }


def _table(rows: list[dict[str, Any]]) -> str:
    best = min(r["makespan_in_1f1b_stages"] for r in rows)
    header = [
        "schedule", "place", "d", "m", "makespan", "makespan/1F1B", "vs best", "bubble",
        "idle", "peak", "peak/1F1B", "recv buf",
    ]
    cells = [
        [
            r["name"],
            r["placement"],
            str(r["devices"]),
            str(r["microbatches"]),
            f"{r['makespan']:g}",
            f"{r['makespan_in_1f1b_stages']:g}",
            f"{r['makespan_in_1f1b_stages'] / best:.3f}" if best > 0 else "-",
            f"{r['bubble_ratio']:.4f}",
            f"{r['idle_fraction']:.4f}",
            format_short(r["peak_memory"], 4),
            format_short(r["peak_memory_per_1f1b_stage"], 4),
            str(r["receive_buffers_peak"]),
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(c[k]) for c in cells)) for k, h in enumerate(header)]
    left = {0, 1}
    lines = [
        "  ".join(h.ljust(w) if k in left else h.rjust(w) for k, (h, w) in enumerate(
            zip(header, widths, strict=True)))
    ]
    for c in cells:
        lines.append("  ".join(
            x.ljust(w) if k in left else x.rjust(w)
            for k, (x, w) in enumerate(zip(c, widths, strict=True))
        ))
    lines.append(
        "makespan and peak (activation memory) in each file's own units; /1F1B: in units "
        "of one 1F1B stage (v chunks per device: costs and M_B scaled by 1/v); "
        "bubble: the zero-bubble paper's ratio"
    )
    return "\n".join(lines) + "\n"


def _differences(rows: list[dict[str, Any]]) -> list[str]:
    notes = []
    for key, what in (("costs", "pass costs"), ("memory_model", "memory models")):
        if len({r[key] for r in rows}) > 1:
            listed = "; ".join(f"{r['name']}: {r[key]}" for r in rows)
            notes.append(
                f"note: the files declare different {what} ({listed}); "
                f"{'timings' if key == 'costs' else 'peaks'} compare only under the same ones"
            )
    return notes


def run(args: argparse.Namespace) -> ExitCode:
    defines = parse_defines(args.defines)
    costs = costs_from_args(args)
    compiled: list[tuple[str, Compiled]] = []
    errors: list[Diagnostic] = []
    for file in args.files:
        try:
            compiled.append((file, compile_file(file, defines, costs=costs)))
        except CompileError as err:
            errors.extend(err.diagnostics)
    if errors:  # every file's findings, not just the first file's
        raise CompileError(errors)
    warnings = [w for _, c in compiled for w in c.warnings]
    if warnings:
        print(render_all(warnings, sys.stderr), file=sys.stderr)
    rows = [_row(file, c) for file, c in compiled]
    notes = _differences(rows)
    if args.json:
        out = [
            {k: (float(v) if isinstance(v, Fraction) else v) for k, v in r.items()}
            for r in rows
        ]
        print(json.dumps({"schedules": out, "notes": notes}, indent=2))
    else:
        sys.stdout.write(_table(rows))
        for note in notes:
            print(note, file=sys.stderr)
    return ExitCode.OK

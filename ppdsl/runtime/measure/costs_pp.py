"""A profile written as a costs file: the `cost` and `memory` statements of the
language, per stage, that `--costs-from` reads (docs/language.md, "Costs
files"): costs in milliseconds, memory in units of the mean stage's M_B, and a
header of comments saying how each was measured."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from decimal import Decimal

import numpy as np

from ppdsl import __version__
from ppdsl.costs_file import PROFILED_STAGES
from ppdsl.runtime.measure.records import Profile, StepCosts, engine_where, norms_pass
from ppdsl.semantics import cost_decimal, per_stage_text

__all__ = ["to_costs_pp", "to_costs_pp_in_tokens", "fit_in_tokens"]

_KINDS = ("F", "B", "W", "BW")


def to_costs_pp(profile: Profile, command: str | None = None) -> str:
    """The profile as a `.pp` file of `cost` and `memory` statements (per stage)
    that `--costs-from` reads: costs in milliseconds, memory in units of the mean
    stage's M_B (the header says how many bytes that is). The pass costs are the
    engine's (`StepCosts.engine_pass_ms`: profile = run) where it measured them,
    else the stage runs'."""
    unit = profile.memory_unit_bytes()
    stages = profile.stages
    engine = profile.step.engine_pass_ms if profile.step is not None else {}
    kinds = _pass_costs(profile, engine)
    from_engine = all(f"{k}{st.stage}" in engine for k in kinds for st in stages)
    lines = [
        *_header(profile, command, unit, from_engine),
        "schedule profile {",
        f"    let {PROFILED_STAGES} = {profile.num_stages}",
        *(f"    cost {kind}[s] = " + per_stage_text([cost_decimal(x) for x in values])
          for kind, values in kinds.items()),
        f"    cost comm = {cost_decimal(profile.comm_ms())}",
        *([f"    cost recv = {cost_decimal(profile.recv_ms)}"] if profile.recv_ms is not None else []),
        *([
            "    cost reduce[s] = " + per_stage_text([cost_decimal(s.reduce_ms or 0.0) for s in stages]),
            "    cost gather[s] = " + per_stage_text([cost_decimal(s.gather_ms or 0.0) for s in stages]),
        ] if profile.dp > 1 else []),
        *_step_statements(profile.step),
        "    memory M_B[s] = "
        + per_stage_text([cost_decimal(s.timing.activation_bytes / unit) for s in stages]),
        "    memory M_W[s] = "
        + per_stage_text([cost_decimal(s.timing.weight_bytes / unit) for s in stages]),
        "}",
    ]
    return "\n".join(lines) + "\n"


def _pass_costs(profile: Profile, engine: dict[str, float]) -> dict[str, list[float]]:
    """Each pass kind's cost per stage: the engine's where measured, else the
    stage runs' (T_F, T_I, T_W, T_B fused)."""
    kinds: dict[str, list[float]] = {kind: [] for kind in _KINDS}
    for st in profile.stages:
        t = st.timing
        own = {"F": t.forward_ms, "B": t.input_ms, "W": t.weight_ms, "BW": t.fused_ms}
        for kind, values in kinds.items():
            values.append(engine.get(f"{kind}{st.stage}", own[kind]))
    return kinds


def _header(profile: Profile, command: str | None, unit: float, from_engine: bool) -> list[str]:
    """The comments above the statements: what was measured, where and how."""
    rows = [
        f"#   stage {s.stage}: T_F {s.timing.forward_ms:.4f}  T_B {s.timing.input_ms:.4f}"
        f"  T_W {s.timing.weight_ms:.4f}  T_BW {s.timing.fused_ms:.4f} ms;"
        f"  M_B {s.timing.activation_bytes}  M_W {s.timing.weight_bytes} bytes"
        for s in profile.stages]
    step = profile.step
    return [
        f"# Measured by ppdsl profile {__version__}"
        + (f": {command}" if command else f": {profile.model}, {profile.num_stages} stages"),
        f"# microbatch {profile.microbatch_size}, {profile.device}"
        + (f" ({profile.threads} thread{'s' if profile.threads != 1 else ''})"
           if profile.threads else "")
        + f", torch {profile.torch_version}; median of {profile.repeats} after {profile.warmup} warm-up.",
        "# Costs in milliseconds ("
        + ("this thread's CPU time" if profile.clock == "thread" else "wall time")
        + "); memory in units of the mean stage's M_B "
        f"(1 unit = {unit:.0f} bytes); layer norms' weight gradients in {norms_pass(profile.norms)}.",
        (f"# transfer (cost comm): in the engine's pipeline ({engine_where(profile.devices)}),"
         " the mean time from a sender's pass end to the start of the receiver's next pass, "
         "when the receiver waited for it, less the overhead per pass; alone, "
         f"{profile.transfer_method}: {profile.boundary_ms():.4f} ms"
         if step is not None and step.latency_ms is not None else
         f"# transfer (cost comm, mean of the stage boundaries): {profile.transfer_method}"),
        *(["# cost recv: a receive posted after its data was sent, between two gloo "
           "processes (the receiver's own part of every transfer)"]
          if profile.recv_ms is not None else []),
        *([f"# data parallel over {profile.dp} ranks: cost reduce = "
           + ("all-reduce" if profile.dp_mode == "replicate" else "reduce-scatter")
           + f" of a stage's gradients, cost gather = all-gather; {profile.collective_method}"]
          if profile.dp > 1 else []),
        *rows,
        *(["# pass costs: the passes as `ppdsl run`'s engine ran them ("
           + engine_where(profile.devices) + ", timed as the run times passes: "
           + ("CUDA events" if profile.clock == "cuda-events" else "wall time")
           + "); the stage lines above are the profile's own runs"] if from_engine else []),
        *([f"# step besides passes: overhead = the engine's work per pass (wall time), "
           f"optimizer = {step.optimizer}'s step per stage, norm = the gradient-norm "
           "all-reduce between two gloo processes, jitter = the spread of the engine's pass "
           "times (IQR / 1.349 of log(duration / median))"] if step is not None else []),
        "# Use with: ppdsl check|show|stats|compare|search ... --costs-from THIS_FILE",
    ]


def _step_statements(step: StepCosts | None) -> list[str]:
    """`cost overhead`, `cost optimizer[s]`, `cost norm`, `cost jitter` (those measured)."""
    if step is None:
        return []
    lines = [f"    cost overhead = {cost_decimal(step.overhead_ms)}",
             "    cost optimizer[s] = " + per_stage_text([cost_decimal(x) for x in step.optimizer_ms])]
    if step.norm_ms is not None:
        lines.append(f"    cost norm = {cost_decimal(step.norm_ms)}")
    if step.jitter > 0:
        lines.append(f"    cost jitter = {cost_decimal(step.jitter)}")
    return lines


def fit_in_tokens(lengths: Sequence[int], values: Sequence[float]) -> tuple[float, float, float]:
    """(a, b, c) >= 0 with a + b*t + c*t^2 closest to `values` at `lengths` in
    least squares (non-negative, so the cost is >= 0 at every length, as the
    language requires: the best over the subsets of the three terms that
    solve with no negative coefficient); c = 0 with fewer than 3 lengths."""
    t = np.asarray(lengths, dtype=np.float64)
    y = np.asarray(values, dtype=np.float64)
    terms = np.stack([np.ones_like(t), t, t * t], axis=1)
    usable = 3 if len(set(lengths)) >= 3 else 2
    best: tuple[float, tuple[float, float, float]] | None = None
    for chosen in itertools.chain.from_iterable(
            itertools.combinations(range(usable), k) for k in range(1, usable + 1)):
        solution, *_ = np.linalg.lstsq(terms[:, chosen], y, rcond=None)
        if (solution < 0).any():
            continue
        coef = [0.0, 0.0, 0.0]
        for k, x in zip(chosen, solution.tolist(), strict=True):
            coef[k] = x
        residual = float(np.sum((terms @ np.array(coef) - y) ** 2))
        if best is None or residual < best[0]:
            best = (residual, (coef[0], coef[1], coef[2]))
    return best[1] if best is not None else (0.0, 0.0, 0.0)


def _in_tokens(coef: tuple[float, float, float], longest: int) -> str:
    """a + b*tokens + c*tokens^2, leaving out a term worth less than a
    millionth of the whole at the longest length measured (a fit's float noise)."""
    a, b, c = coef
    whole = a + b * longest + c * longest * longest
    keep = [x > 1e-6 * whole for x in (a, b * longest, c * longest * longest)]
    terms = ([cost_decimal(a)] if keep[0] else []) + ([f"{_small(b)}*tokens"] if keep[1] else []) \
        + ([f"{_small(c)}*tokens^2"] if keep[2] else [])
    return " + ".join(terms) or "0"


def _small(x: float) -> str:
    """A small positive coefficient as an exact decimal the language reads
    (it has no exponent notation): 6 significant digits."""
    text = f"{x:.6g}"
    if "e" not in text:
        return text
    return format(Decimal(text), "f")


def to_costs_pp_in_tokens(profiles: Sequence[Profile], command: str | None = None) -> str:
    """Profiles of one model at several lengths (`Profile.seq_len`) as a costs
    file in tokens: each pass kind's cost and M_B, M_W per stage as `a +
    b*tokens + c*tokens^2` (`fit_in_tokens`; memory in bytes), the transfer and
    receive costs those of the longest length; the lengths and each one's
    measurements in the header."""
    ordered = sorted(profiles, key=lambda p: p.seq_len or 0)
    lengths = [p.seq_len or 0 for p in ordered]
    longest = ordered[-1]
    stages = range(longest.num_stages)
    kinds = {kind: [fit_in_tokens(lengths, [_pass_costs(p, {})[kind][s] for p in ordered])
                    for s in stages] for kind in _KINDS}
    memory = {name: [fit_in_tokens(lengths, [float(getattr(p.stages[s].timing, field))
                                             for p in ordered]) for s in stages]
              for name, field in (("M_B", "activation_bytes"), ("M_W", "weight_bytes"))}
    lines = [
        f"# Measured by ppdsl profile {__version__}"
        + (f": {command}" if command else f": {longest.model}, {longest.num_stages} stages"),
        f"# at {len(lengths)} lengths (tokens per sample): {', '.join(map(str, lengths))};"
        f" microbatch {longest.microbatch_size}, {longest.device}; median of "
        f"{longest.repeats} after {longest.warmup} warm-up.",
        "# Costs in milliseconds, memory in bytes: least-squares fits with no negative "
        "term (docs/language.md, Costs in tokens). Measured:",
        *(f"#   tokens {p.seq_len} stage {s.stage}: T_F {s.timing.forward_ms:.4f}  "
          f"T_B {s.timing.input_ms:.4f}  T_W {s.timing.weight_ms:.4f}  "
          f"T_BW {s.timing.fused_ms:.4f} ms;  M_B {s.timing.activation_bytes}  "
          f"M_W {s.timing.weight_bytes} bytes" for p in ordered for s in p.stages),
        "schedule profile {",
        f"    let {PROFILED_STAGES} = {longest.num_stages}",
        *(f"    cost {kind}[s] = " + per_stage_text([_in_tokens(c, lengths[-1]) for c in values])
          for kind, values in kinds.items()),
        f"    cost comm = {cost_decimal(longest.comm_ms())}",
        *([f"    cost recv = {cost_decimal(longest.recv_ms)}"]
          if longest.recv_ms is not None else []),
        *(f"    memory {name}[s] = " + per_stage_text([_in_tokens(c, lengths[-1]) for c in values])
          for name, values in memory.items()),
        "}",
    ]
    return "\n".join(lines) + "\n"

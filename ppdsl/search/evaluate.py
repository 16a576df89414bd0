"""The search's evaluator: time a set of per-device orders as soon as possible
and measure makespan, bubble ratio and peak memory.

It is the compiler's own flat executor and metrics kernel
(`ppdsl.analysis.executor`: the dependency relation and transfer rule of
`ppdsl.semantics`, run over flat arrays), so a candidate scores exactly as the
compiled `.pp` file will simulate. Orders travel as flat int arrays: device
`dev` owns entries `offsets[dev]:offsets[dev+1]` of `kind` (`PassKind.code`),
`microbatch`, `stage`.
"""

from __future__ import annotations

from ppdsl.analysis.executor import Metrics, evaluate, timed

__all__ = ["Metrics", "evaluate_orders", "time_orders"]


time_orders = timed
"""ASAP (start, end, ok) per flat pass: `timed(offsets, kind, microbatch, stage,
stage_device, dur, comm, num_microbatches)`; ok=False on a cycle of waits."""

evaluate_orders = evaluate
"""Time the orders and measure them: `evaluate(offsets, kind, microbatch, stage,
stage_device, dur, comm, mem, num_microbatches)` with `dur[kind, stage]` float
and `mem[kind, stage]` integer memory deltas (`semantics.delta_table`)."""

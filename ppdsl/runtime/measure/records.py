"""What `ppdsl profile` measured, as records: one stage's timing
(`StageTiming`), a stage with what it sends on and what the split leaves out
(`StageProfile`), the step's costs besides passes (`StepCosts`), and the whole
profile (`Profile`) with its JSON and its human-readable table.

Times are in milliseconds, memory in bytes; how each was measured is said
beside its field and in `ppdsl.runtime.measure.profile`."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ppdsl import __version__

__all__ = ["StageTiming", "StageProfile", "StepCosts", "Profile", "write_json", "engine_where",
           "norms_pass"]


@dataclass(frozen=True)
class StageTiming:
    """One stage measured on one microbatch (times in milliseconds, medians)."""

    forward_ms: float
    """T_F: the forward as a split schedule's F runs it."""
    input_ms: float
    """T_I: the B pass (input gradient; weight-gradient work deferred)."""
    weight_ms: float
    """T_W: the W pass (the deferred weight-gradient work)."""
    plain_forward_ms: float
    """The plain stage's forward, timed in the run of the fused backward."""
    fused_ms: float
    """T_B (fused): the plain stage's backward, what a BW pass runs."""
    activation_bytes: int
    """M_B: bytes one microbatch keeps after its F (the runtime's meter)."""
    plain_activation_bytes: int
    """The same after the plain run's forward."""
    weight_bytes: int
    """M_W: bytes it still keeps after its B (what W reads)."""
    gradient_bytes: int
    """Output gradients the W stash holds (gradient buffers, outside M_W)."""

    @property
    def forward_ratio(self) -> float:
        """Split forward time / plain forward time."""
        return self.forward_ms / self.plain_forward_ms

    @property
    def backward_ratio(self) -> float:
        """(T_I + T_W) / T_B (fused)."""
        return (self.input_ms + self.weight_ms) / self.fused_ms

    @property
    def bytes_ratio(self) -> float:
        """Split M_B / plain M_B."""
        return self.activation_bytes / max(self.plain_activation_bytes, 1)


@dataclass(frozen=True)
class StageProfile:
    """A stage's timing, what it sends on, and what the split leaves out."""

    stage: int
    timing: StageTiming
    boundary_bytes: int
    """Bytes of the activation the stage sends to the next (0 for the last)."""
    transfer_ms: float | None
    """Measured time to move that tensor to another rank (None for the last stage)."""
    uncovered: tuple[str, ...]
    """Parameters whose gradient B computes (the split does not cover them)."""
    param_bytes: int = 0
    """Bytes of the stage's parameters (what data parallelism reduces and gathers)."""
    reduce_ms: float | None = None
    """`--dp`: measured reduction of the stage's gradients over dp ranks (all-reduce,
    or reduce-scatter under shard), else None."""
    gather_ms: float | None = None
    """`--dp`: measured all-gather of the stage's parameters over dp ranks."""


@dataclass(frozen=True)
class StepCosts:
    """The costs of a training step besides its passes and transfers (ms):
    `cost overhead`, `cost optimizer[s]`, `cost norm` (`semantics.STEP_COSTS`)."""

    overhead_ms: float
    """The runtime's own work per pass: the stages' passes run through the
    engine (`PipelineRunner`, `Profile.devices` processes), its step time less
    the time inside passes and waiting on receives, over the passes (posting
    transfers counts); the mean over the timed steps (`semantics.pass_cost`)."""
    engine_pass_ms: dict[str, float]
    """The mean pass time as the engine ran it (`semantics.pass_cost`), per
    `KIND` + stage (`F0`), timed as `ppdsl run` times passes (wall time on CPU, CUDA events on CUDA): the pass
    costs `to_costs_pp` writes (profile = run)."""
    optimizer_ms: tuple[float, ...]
    """Per stage, the optimizer step of its parameters (with their norms), the
    mean over the timed steps."""
    optimizer: str
    """The optimizer timed (`ppdsl run --optimizer`'s choices)."""
    norm_ms: float | None
    """The gradient-norm all-reduce between two gloo processes (None: not
    measured, e.g. --no-transfer)."""
    jitter: float = 0.0
    """`cost jitter`: how much the engine's passes varied from one run of a pass
    to the next, the spread of log(duration / that pass's median) from its
    quartiles, pooled over every pass kind and stage (`pass_jitter`)."""
    latency_ms: float | None = None
    """`cost comm` as the pipeline of processes saw it (`pipeline_latency`);
    None: not measured (one process, or --no-transfer)."""


@dataclass(frozen=True)
class Profile:
    """What `ppdsl profile` measured."""

    model: str
    num_stages: int
    microbatch_size: int
    device: str
    threads: int
    warmup: int
    repeats: int
    transfer_method: str
    stages: tuple[StageProfile, ...]
    torch_version: str = field(default_factory=lambda: torch.__version__)
    clock: str = "wall"
    """What the pass times count: "wall" time, or "thread" CPU time (CPU, one
    torch thread: the passes' own work, not time other processes took)."""
    norms: str = "in-b"
    """When the split computes layer norms' weight gradients: "in-b" or "deferred"
    (`split.backward_input`)."""
    dp: int = 1
    """Data-parallel ranks the collectives were measured over (1: not measured)."""
    dp_mode: str = "replicate"
    """What `cost reduce` stands for: an all-reduce (replicate) or a reduce-scatter (shard)."""
    collective_method: str = "not measured"
    """How the collectives were measured."""
    precision: str = "fp32"
    """fp32, or bf16/fp16: the forward and loss ran under autocast."""
    tf32: str = "n/a"
    """On CUDA, whether float32 matmuls and convolutions may use TF32 (they
    change fp32 times several-fold): torch's settings when measured."""
    step: StepCosts | None = None
    """What a training step spends besides passes and transfers (None: not
    measured)."""
    devices: int = 1
    """The processes the engine's passes were timed on (`measure_pipeline`):
    1, this one with every stage; more, a pipeline of that many gloo ranks
    with the stages placed looped, as a run of that many ranks runs them."""
    recv_ms: float | None = None
    """`cost recv`, the receiver's own part of a transfer: a receive posted after
    its data was sent, from posting to holding the tensor, between two gloo
    processes (`measure_receive`; the mean over the stage boundaries; None: not
    measured, e.g. on CUDA or with --no-transfer)."""
    seq_len: int | None = None
    """The tokens per sample the passes were measured at (`ppdsl profile
    --lengths`), or None: the model's own batches."""

    def memory_unit_bytes(self) -> float:
        """Bytes of one memory unit of the costs file: the mean stage's M_B."""
        return statistics.fmean(s.timing.activation_bytes for s in self.stages) or 1.0

    def comm_ms(self) -> float:
        """The one transfer cost of the language: the transfers' latency in the
        engine's pipeline of processes when measured (`StepCosts.latency_ms`),
        else the mean of the measured boundaries."""
        if self.step is not None and self.step.latency_ms is not None:
            return self.step.latency_ms
        return self.boundary_ms()

    def boundary_ms(self) -> float:
        """The transfer measured alone (`transfer_method`), the mean of the
        stage boundaries (0: not measured)."""
        found = [s.transfer_ms for s in self.stages if s.transfer_ms is not None]
        return statistics.fmean(found) if found else 0.0

    def to_json(self) -> dict[str, Any]:
        """Everything measured, per stage, with the derived ratios."""
        stages = []
        for s in self.stages:
            t = s.timing
            stages.append({
                "stage": s.stage,
                **asdict(t),
                "mw_over_mb": t.weight_bytes / max(t.activation_bytes, 1),
                "forward_ratio": t.forward_ratio,
                "backward_ratio": t.backward_ratio,
                "bytes_ratio": t.bytes_ratio,
                "split_overhead": (t.forward_ms + t.input_ms + t.weight_ms)
                / (t.plain_forward_ms + t.fused_ms) - 1.0,
                "boundary_bytes": s.boundary_bytes,
                "transfer_ms": s.transfer_ms,
                "param_bytes": s.param_bytes,
                "reduce_ms": s.reduce_ms,
                "gather_ms": s.gather_ms,
                "uncovered_parameters": list(s.uncovered),
            })
        return {
            "ppdsl_version": __version__,
            "model": self.model,
            "num_stages": self.num_stages,
            "microbatch_size": self.microbatch_size,
            "device": self.device,
            "threads": self.threads,
            "torch_version": self.torch_version,
            "warmup": self.warmup,
            "repeats": self.repeats,
            "clock": self.clock,
            "precision": self.precision,
            "tf32": self.tf32,
            "norms": self.norms,
            "transfer_method": self.transfer_method,
            "comm_ms": self.comm_ms(),
            "recv_ms": self.recv_ms,
            "devices": self.devices,
            "dp": self.dp,
            "dp_mode": self.dp_mode,
            "collective_method": self.collective_method,
            "memory_unit_bytes": self.memory_unit_bytes(),
            "step": asdict(self.step) if self.step is not None else None,
            "stages": stages,
        }

    def table(self) -> str:
        """The human-readable report."""
        head = (
            f"{'stage':>5} {'T_F':>8} {'T_B':>8} {'T_I':>8} {'T_W':>8} {'plain F':>8}"
            f" {'M_B':>11} {'M_W':>11} {'M_W/M_B':>7} {'F x':>6} {'I+W/B':>6}"
            f" {'bytes x':>7} {'send':>10} {'xfer':>7}"
        )
        clock = {"thread": "this thread's CPU time", "cuda-events": "CUDA events"}.get(
            self.clock, "wall time")
        where = (f"{self.device} ({self.threads} thread{'s' if self.threads != 1 else ''})"
                 if self.threads else f"{self.device} (TF32: {self.tf32})")
        lines = [
            f"{self.model}: {self.num_stages} stages, microbatch {self.microbatch_size}, "
            f"{where}, {self.precision}, "
            f"median of {self.repeats} after {self.warmup} warm-up; times in ms ({clock}), "
            f"memory in bytes; layer norms' weight gradients in {norms_pass(self.norms)}",
            head,
        ]
        for s in self.stages:
            t = s.timing
            lines.append(
                f"{s.stage:>5} {t.forward_ms:8.3f} {t.fused_ms:8.3f} {t.input_ms:8.3f}"
                f" {t.weight_ms:8.3f} {t.plain_forward_ms:8.3f} {t.activation_bytes:>11}"
                f" {t.weight_bytes:>11} {t.weight_bytes / max(t.activation_bytes, 1):7.3f}"
                f" {t.forward_ratio:6.3f} {t.backward_ratio:6.3f} {t.bytes_ratio:7.3f}"
                f" {s.boundary_bytes:>10}"
                f" {s.transfer_ms if s.transfer_ms is not None else float('nan'):7.3f}"
            )
        lines.append(
            "T_F: forward; T_B: fused backward (BW); T_I, T_W: the split's B and W; plain F: "
            "the plain stage's forward; F x = T_F / plain F; I+W/B = (T_I + T_W) / T_B; "
            "bytes x = M_B / plain M_B"
        )
        lines.append(f"transfer: {self.transfer_method}")
        if self.recv_ms is not None:
            lines.append(f"receive posted after its data was sent (cost recv): "
                         f"{self.recv_ms:.3f} ms")
        lines += self._collective_lines() + self._step_lines()
        for s in self.stages:
            if s.uncovered:
                lines.append(
                    f"note: stage {s.stage}: not split (gradient during B): {', '.join(s.uncovered)}"
                )
        return "\n".join(lines) + "\n"


    def _collective_lines(self) -> list[str]:
        """`--dp`: each stage's collectives, and how they were measured."""
        if self.dp <= 1:
            return []
        reduce = "all-reduce" if self.dp_mode == "replicate" else "reduce-scatter"
        lines = [
            f"stage {s.stage}: {s.param_bytes} parameter bytes: {reduce} "
            f"{s.reduce_ms if s.reduce_ms is not None else float('nan'):.3f} ms, all-gather "
            f"{s.gather_ms if s.gather_ms is not None else float('nan'):.3f} ms over {self.dp} ranks"
            for s in self.stages]
        lines.append(f"collectives: {self.collective_method}")
        return lines

    def _step_lines(self) -> list[str]:
        """The step besides passes and the passes as the engine ran them."""
        if self.step is None:
            return []
        st = self.step
        engine = "  ".join(f"{k} {v:.3f}" for k, v in st.engine_pass_ms.items())
        lines = [
            f"step besides passes: engine overhead {st.overhead_ms:.3f} ms per pass; "
            f"{st.optimizer} step " + ", ".join(f"{x:.3f}" for x in st.optimizer_ms)
            + " ms per stage; norm all-reduce "
            + (f"{st.norm_ms:.3f} ms" if st.norm_ms is not None else "not measured")
            + f"; passes' jitter {st.jitter:.3f} (IQR / 1.349 of log(duration / median))",
            f"passes as the engine ran them (wall ms, mean): {engine}; "
            + engine_where(self.devices),
        ]
        if st.latency_ms is not None:
            lines.append(f"transfers in that pipeline: {st.latency_ms:.3f} ms from a sender's "
                         "pass (with the overhead) to the start of the receiver's, when it "
                         f"waited (cost comm; {self.boundary_ms():.3f} ms measured alone)")
        return lines


def engine_where(devices: int) -> str:
    """Where the engine's passes were timed, in words."""
    if devices == 1:
        return "every stage on one process"
    return f"a pipeline of {devices} gloo processes, the stages placed looped"


def norms_pass(norms: str) -> str:
    """The pass that computes layer norms' weight gradients under `norms`."""
    return "B" if norms == "in-b" else "W"


def write_json(profile: Profile, path: str | Path) -> None:
    """The profile's JSON (as `--json` prints it) into `path`."""
    Path(path).write_text(json.dumps(profile.to_json(), indent=2) + "\n", encoding="utf-8")

"""ppdsl as a library: a proven schedule inside your own training loop.

    schedule = load_schedule("examples/zb_h1.pp", {"d": 4, "m": 8})
    runner = PipelineRunner(schedule, stages=build_stage, loss_fn=loss)
    optimizer = torch.optim.AdamW(runner.parameters(), lr=3e-4)
    stepper = OptimizerStep(runner, optimizer, max_norm=1.0, validation="post")
    for inputs, targets in loader:          # only where they are used (below)
        optimizer.zero_grad()
        loss = runner.step(inputs, targets)  # the last stage's rank: the mean loss
        stepper.step()
        scheduler.step()

`load_schedule` compiles a `.pp` file (every rank may, it is deterministic; the
runner checks that all ranks run the same schedule). `PipelineRunner` builds this
rank's stages from your modules and runs one step's passes per `step` call,
gradients left in the parameters; inputs are only needed on the rank holding
stage 0 and targets on the rank holding the last stage (other ranks pass None).
The first `step` probes the shapes between stages with its first microbatch.
Under a bidirectional placement (`place dualpipe`) each model stage is held twice,
once per direction: the runner builds both copies from the same factory call
(`stages(k)` for model stage k); they, like tied parameters, are kept equal by
`ppdsl.runtime.execution.ties`, attached through `Hooks`.
Everything collective runs on `group` (default: the world); with `mesh` (a 2-D
DeviceMesh ("dp", "pp"), `ppdsl.runtime.execution.data_parallel.dp_pp_mesh`) the runner is
one replica's pipeline: its group is the mesh's "pp" group and its gradients are
combined over "dp" (`dp_mode` "replicate" or "shard", docs/runtime.md);
`Hooks` are the points of entry such a layer uses.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ppdsl.ir.schedule import MemoryModel
from ppdsl.runtime.errors import ModelError
from ppdsl.runtime.execution.buffers import kept_buffers
from ppdsl.runtime.execution.compiled import CompiledPipeline, ScheduleError, load_schedule
from ppdsl.runtime.execution.data_parallel import (
    MODES,
    DataParallel,
    broadcast_replica_zero,
    shard_stages,
)
from ppdsl.runtime.execution.dtensor import is_sharded
from ppdsl.runtime.execution.engine import Engine, Hooks, StepResult
from ppdsl.runtime.execution.group import LaneEnds, agree, differing, global_rank
from ppdsl.runtime.execution.memory import DevicePeak, MemoryMeter
from ppdsl.runtime.execution.precision import LossScaler, autocast_dtype, cast_parameters
from ppdsl.runtime.execution.shapes import given_microbatches
from ppdsl.runtime.execution.split import uncovered_in
from ppdsl.runtime.execution.structure import (
    Spec,
    StructureError,
    call_stage,
    flatten,
    split_microbatches,
    unflatten,
)
from ppdsl.runtime.execution.ties import Ties, check_ties, copy_groups, tie_parameters
from ppdsl.runtime.execution.trace import Tracer
from ppdsl.runtime.execution.transport import Transport, backend_for

__all__ = [
    "CompiledPipeline",
    "PipelineRunner",
    "ScheduleError",
    "load_schedule",
    "tie_parameters",
]

def _default_note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _validate_arguments(group: dist.ProcessGroup | None, mesh: Any,
                        dp_mode: str) -> tuple[dist.ProcessGroup | None, Any]:
    """The pipeline's group and the DP mesh (None without `mesh`); the errors a
    caller's arguments alone show, before anything collective."""
    if not dist.is_initialized():
        raise RuntimeError("PipelineRunner needs torch.distributed initialised "
                           "(dist.init_process_group, e.g. under torchrun)")
    if dp_mode not in MODES:
        raise ValueError(f"dp_mode must be one of {', '.join(MODES)}, not {dp_mode!r}")
    if mesh is None:
        return group, None
    if group is not None:
        raise ValueError("give either group or mesh (whose 'pp' group is the pipeline's)")
    if tuple(mesh.mesh_dim_names or ()) != ("dp", "pp"):
        raise ValueError(f"mesh must be 2-D with dims ('dp', 'pp'), not {mesh.mesh_dim_names}")
    return mesh["pp"].get_group(), mesh["dp"]


def _default_device(device: torch.device | str | None, group: dist.ProcessGroup | None,
                    share_gpu: bool) -> torch.device:
    """`device`, else this process's GPU where the group serves CUDA tensors
    (or the ranks share GPUs), else the CPU."""
    if device is not None:
        return torch.device(device)
    # by the backend serving CUDA tensors, not the group's name ("undefined"
    # for a group made without one)
    cuda = torch.device("cuda")
    if torch.cuda.is_available() and (share_gpu or backend_for(group, cuda) == "nccl"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class PipelineRunner:
    """This rank's part of a pipeline: its stages, the schedule's passes, one step
    per `step` call.

    `stages`: this rank's stage modules, as {stage index: module} (other indices
    are ignored) or a function building stage i (model stage i under a
    bidirectional placement: both copies come from it). `loss_fn(output, target)` is the
    batch's *mean* loss; the runner sums loss(mb)/m over the m microbatches.
    `group`: the pipeline's process group (default: the world); its rank r runs
    the schedule's rank r. `precision`: "fp32", "bf16" or "fp16" (forward and loss
    under autocast; fp16 scales the loss, `scaler`). `release`: "at-b" or "at-w" (when a
    split backward frees activations, docs/runtime.md). `tied`: groups of
    parameters shared between stages, each {stage: parameter name}: the runner
    makes those on one rank one Parameter, copies the lowest stage's values to the
    other owners at start, and sums their gradients after each step's passes.
    `share_gpu`: the ranks share GPUs (fewer GPUs than ranks on a node; a
    development mode: they time-slice the GPU): transfers are staged through
    pinned host memory over gloo (`ppdsl.runtime.execution.transport`); the group must have
    a CPU backend. `transfer_mode` forces a transport mode ("tagged", "ordered",
    "staged"; tests run the NCCL and staged paths on CPU tensors over gloo).
    `param_dtype`: the dtype the stages' parameters are kept and computed in
    (None: as the model built them); bf16 takes fp32 master weights in the
    optimizer (`ppdsl.runtime.execution.precision.MasterWeights`), and the
    inputs' floating-point tensors are cast to it, as FSDP2's
    MixedPrecisionPolicy casts a module's inputs; in shard mode that policy
    itself does it (its shards, what the optimizer holds, stay fp32).
    `reduce_dtype`: the dtype data parallelism reduces gradients in (None: the
    gradients' own).
    Construction is collective over `group` (the ranks check they run the same
    schedule)."""

    def __init__(
        self,
        schedule: CompiledPipeline,
        stages: Mapping[int, nn.Module] | Callable[[int], nn.Module],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        precision: str = "fp32",
        release: str = "at-b",
        tied: Sequence[Mapping[int, str]] = (),
        timeout: float = 60.0,
        note: Callable[[str], None] = _default_note,
        mesh: Any = None,
        dp_mode: str = "replicate",
        share_gpu: bool = False,
        transfer_mode: str | None = None,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        group, dp_mesh = _validate_arguments(group, mesh, dp_mode)
        self.param_dtype = param_dtype
        """The stages' parameter dtype (None: the model's own)."""
        self.reduce_dtype = reduce_dtype
        """The dtype of data parallelism's gradient reductions (None: the gradients')."""
        self.schedule = schedule
        self.plan = schedule.plan
        self.group = group
        self.rank = dist.get_rank(group)
        """This process's rank in the pipeline (the schedule's rank it runs)."""
        self.device = _default_device(device, group, share_gpu)
        self.transport = Transport(group, self.device, staged=share_gpu, mode=transfer_mode)
        """How tensors move between this pipeline's ranks (`ppdsl.runtime.execution.transport`)."""
        self.note = note
        self.tied = [dict(g) for g in tied]
        self.stage_indices = schedule.stages_of(self.rank)
        self.stages: dict[int, nn.Module] = self._build(stages, dp_mesh, dp_mode)
        """This rank's stage modules, by stage index (FSDP modules in shard mode)."""
        self.loss_fn = loss_fn
        self.scaler = LossScaler(self.device) if precision == "fp16" else None
        """fp16's loss scale (GradScaler semantics, one decision for all ranks), or None."""
        self.precision = precision
        self.specs: dict[int, Spec] | None = None
        """Every stage's output structure, known after the first step's probe."""
        self.uncovered: dict[int, list[str]] = {}
        """Per stage of this rank: parameters whose gradient B computes (the split
        does not cover them), known after the first step."""
        self.steps_run = 0
        self.last_result: StepResult | None = None
        """The last `step()`'s result (loss, elapsed and compute seconds), or None."""
        self._input_spec: Spec | None = None
        self._eval_engine: Engine | None = None
        self._wire(release, timeout, dp_mesh, dp_mode)

    # -- validate, build, wire -----------------------------------------------------

    def _validate(self) -> str | None:
        """Why this rank cannot run the schedule in this group, or None."""
        world = dist.get_world_size(self.group)
        if self.plan.lanes > 1 and self.tied:
            return (f"tied parameters under a placement of {self.plan.lanes} pipelines "
                    "(each stage held twice) are not supported")
        if world != self.plan.num_devices:
            return (f"schedule {self.plan.name!r} was compiled for {self.plan.num_devices} ranks "
                    f"but the process group has {world}")
        if self.rank not in self.schedule.ops:
            return f"rank {self.rank}: the schedule given holds no program for this rank"
        return None

    def _build(self, stages: Mapping[int, nn.Module] | Callable[[int], nn.Module],
               dp_mesh: Any, dp_mode: str) -> dict[int, nn.Module]:
        """This rank's stage modules on its device, ties and copies made one
        Parameter where they share this rank, replica 0's values on every replica
        (sharded in shard mode). Collective: a rank's error (a bad stage, a bad
        tie, a differing schedule) is raised on every rank as ModelError."""
        modules: dict[int, nn.Module] = {}
        error = self._validate()
        if error is None:
            try:
                for s in self.stage_indices:
                    k = self.plan.model_stage(s)
                    module = stages(k) if callable(stages) and not isinstance(stages, Mapping) \
                        else stages.get(k)  # type: ignore[union-attr]
                    if not isinstance(module, nn.Module):
                        raise ModelError(f"stage {s} is {type(module).__name__}, not a torch.nn.Module")
                    modules[s] = module.to(self.device)
                    if self.param_dtype is not None and not (dp_mesh is not None and dp_mode == "shard"):
                        cast_parameters(modules[s], self.param_dtype)
                check_ties(self.tied, self.plan.num_stages, modules)
                tie_parameters(modules, self.tied)
                tie_parameters(modules, copy_groups(self.plan, modules))
                if dp_mesh is not None and dp_mode == "shard" and (self.tied or self.plan.lanes > 1):
                    raise ModelError("tied parameters and a bidirectional placement's stage "
                                     "copies are not supported with dp_mode 'shard' (FSDP shards "
                                     "each stage on its own); use 'replicate'")
            except ModelError as exc:
                error = str(exc)
            except Exception as exc:  # the user's code
                error = f"building the stages failed: {type(exc).__name__}: {exc}"
        error = agree(error, self.group)
        if error is not None:
            raise ModelError(error)
        theirs = differing([self.schedule.fingerprint], self.group)
        if theirs is not None:
            lines = [f"  rank {r}: {fps[0][:12]}" for r, (fps, _) in enumerate(theirs)]
            raise ModelError("the ranks run different compiled schedules\n" + "\n".join(lines))
        if dp_mesh is not None:
            broadcast_replica_zero(modules, dp_mesh.get_group())
            if dp_mode == "shard":
                shard_stages(modules, dp_mesh, param_dtype=self.param_dtype)
        return modules

    def _wire(self, release: str, timeout: float, dp_mesh: Any, dp_mode: str) -> None:
        """The engine on the built stages, and the layers that attach to its
        hooks: the ties and stage copies across ranks (their values made equal
        now), data parallelism."""
        self.engine = Engine(
            self.rank, self.schedule.ops[self.rank], self.plan.stage_device,
            self.plan.num_microbatches, self.plan.memory, self.stages, self.loss_fn, self.device,
            group=self.group, timeout=timeout, release=release,
            autocast_dtype=autocast_dtype(self.precision), lane_ends=LaneEnds.of(self.plan),
            transport=self.transport,
        )
        self.hooks: Hooks = self.engine.hooks
        """Callbacks at a step's points (`ppdsl.runtime.execution.engine.Hooks`)."""
        self.ties = Ties(self.plan, self.rank, self.tied, self.stages, self.transport, self.group,
                         self.engine.timeout)
        """The ties and stage copies that span ranks (`ppdsl.runtime.execution.ties`)."""
        self.ties.sync_values()
        self.ties.attach(self.hooks)
        self.data_parallel: DataParallel | None = None
        """The data-parallel layer (with `mesh`), else None."""
        if dp_mesh is not None:
            self.data_parallel = DataParallel(dp_mode, dp_mesh, self.stages, self.engine.grads_final,
                                              self.engine.first_forward,
                                              reduce_dtype=self.reduce_dtype)
            self.data_parallel.on_gather.append(self.engine.meter.add_parameters)
            self.data_parallel.attach(self.hooks)

    @property
    def norm_groups(self) -> list[dist.ProcessGroup | None]:
        """The groups a global gradient norm sums over: the pipeline's, and the DP
        group where each rank holds a shard of the gradients."""
        dp = self.data_parallel
        return [self.group] + ([dp.group] if dp is not None and dp.mode == "shard" else [])

    # -- what this rank holds ----------------------------------------------------

    @property
    def is_first(self) -> bool:
        """Whether this rank holds stage 0, or a lane's first stage (it is given
        the inputs)."""
        return any(self.plan.is_lane_first(s) for s in self.stages)

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage, or a lane's last stage (it is
        given the targets and returns the loss)."""
        return any(self.plan.is_lane_last(s) for s in self.stages)

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, each once (give them to your optimizer)."""
        return list(self.engine.params)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(`stage{s}.{name}`, parameter) of this rank's parameters, each once."""
        seen: set[int] = set()
        found = []
        for s, module in sorted(self.stages.items()):
            for name, p in module.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    found.append((f"stage{s}.{name}", p))
        return found

    def compute_dtypes(self) -> set[torch.dtype]:
        """The dtypes this rank's parameters have inside the passes: in shard mode
        those of the stages as gathered (FSDP2's `param_dtype`, known once a step
        has run), else those of `parameters()`."""
        dp = self.data_parallel
        if dp is not None and dp.mode == "shard":
            return set(dp.gathered_dtypes)
        return {p.dtype for p in self.engine.params}

    def norm_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients this rank counts in the global gradient
        norm: its own, less tied ones whose lowest owner sits on another rank (each
        tied parameter is counted once across the pipeline), and in shard mode
        less the parameters FSDP keeps whole (0-dim ones) on every replica but the
        first (the norm sums over the DP group, so each is counted once)."""
        skip: set[int] = set()
        dp = self.data_parallel
        if dp is not None and dp.mode == "shard" and dist.get_rank(dp.group) != 0:
            skip.update(id(p) for p in self.engine.params if not is_sharded(p))
        skip |= self.ties.not_counted()
        return [p for p in self.engine.params if id(p) not in skip]

    # -- what a training loop reads ------------------------------------------------

    @property
    def tracer(self) -> Tracer | None:
        """Where this rank's passes are recorded (`ppdsl.runtime.execution.trace.Tracer`), or
        None (the default: nothing recorded)."""
        return self.engine.tracer

    @tracer.setter
    def tracer(self, tracer: Tracer | None) -> None:
        self.engine.tracer = tracer

    @property
    def meter(self) -> MemoryMeter:
        """The memory meter of this rank's passes (peaks in bytes and in the
        compiler's units; it runs in steps given `measure_memory=True`)."""
        return self.engine.meter

    @property
    def device_peak(self) -> DevicePeak | None:
        """The allocator's peak on CUDA, with each pass's working memory of the
        measured steps (`ppdsl.runtime.execution.memory.DevicePeak`); None elsewhere."""
        return self.engine.device_peak

    def measured_mw_ratio(self) -> dict[int, Fraction]:
        """Per stage of this rank: the measured M_W/M_B (what a microbatch still
        holds from its B to its W), once a step has been measured."""
        return self.engine.measured_mw_ratio()

    def measured_mi_ratio(self) -> dict[int, Fraction]:
        """Per recomputed stage of this rank: the measured M_I/M_B (what F keeps)."""
        return self.engine.measured_mi_ratio()

    def stage_bytes(self) -> dict[int, int]:
        """Per stage of this rank: the bytes one microbatch's activation holds."""
        return self.engine.stage_bytes()

    # -- one step ----------------------------------------------------------------

    def step(self, inputs: Any = None, targets: Any = None, *, measure_memory: bool = False,
             lengths: Sequence[int] | None = None,
             weights: Sequence[float] | None = None) -> torch.Tensor | None:
        """One training step's passes. `inputs` (the rank holding stage 0) and
        `targets` (the rank holding the last stage) are the whole batch: a tensor or
        a tuple/list/dict of tensors, cut along dim 0 into the schedule's
        microbatches; other ranks pass None (what they pass is not used).
        Gradients accumulate into `.grad` (zero them between steps). Returns the
        batch's mean loss (detached, unscaled) on the last stage's rank, else None.
        `measure_memory` runs the memory meter for this step (`engine.meter`).

        Documents (docs/runtime.md): `lengths`, each microbatch's tokens (every
        rank alike), with `inputs`/`targets` as lists of the m microbatches;
        `weights`, each one's share of the step's loss (default 1/m)."""
        input_mbs, target_mbs = self._microbatches(inputs, targets, "step()", lengths)
        if input_mbs is not None and self._input_spec is not None and lengths is None:
            spec = flatten(input_mbs[0], "the inputs")[1]
            if spec != self._input_spec:
                raise ValueError(
                    f"the inputs' microbatches are {spec}, but the pipeline was set up for "
                    f"{self._input_spec} at its first step; shapes between stages are fixed"
                )
        scale = self.scaler.scale if self.scaler is not None else None
        result = self.engine.step(input_mbs, target_mbs, measure=measure_memory, loss_scale=scale,
                                  lengths=lengths, weights=weights)
        result.loss = self._batch_loss(result.loss)
        self.steps_run += 1
        self.last_result = result
        return result.loss

    def _given_microbatches(self, inputs: Any, targets: Any,
                            lengths: Sequence[int]) -> tuple[list[Any] | None, list[Any] | None]:
        """A varying-length step's microbatches as given, on this device; the
        first call probes the stages with microbatch 0."""
        m = self.plan.num_microbatches
        if len(lengths) != m:
            raise ValueError(f"step() was given {len(lengths)} lengths for {m} microbatches")
        input_mbs, target_mbs = (
            None if given is None else self._to_device(given, dtype) for given, dtype in (
                (given_microbatches(inputs, self.is_first, m, "inputs", self.rank),
                 self.param_dtype),
                (given_microbatches(targets, self.is_last, m, "targets", self.rank), None)))
        if self.specs is None:
            self._probe(input_mbs[0] if input_mbs else None, probe_tokens=int(lengths[0]))
        return input_mbs, target_mbs

    def evaluate(self, inputs: Any = None, targets: Any = None) -> torch.Tensor | None:
        """A forward-only step (a validation loss): `inputs` and `targets` as for
        `step`, cut into the schedule's m microbatches; every stage in eval mode
        (BatchNorm reads its running statistics, dropout is off), no gradients,
        the schedule's F passes in their order and no B, W or R
        (`ppdsl.compiler.compile_forward`: proven deadlock-free at the first
        call). Collective over the pipeline (and the DP group in shard mode,
        which gathers each stage's weights). Returns the batch's mean loss on the
        last stage's rank (with a mesh: this replica's share's), else None;
        parameters, gradients, buffers and the training mode are left as they
        were."""
        input_mbs, target_mbs = self._microbatches(inputs, targets, "evaluate()")
        engine = self._evaluation_engine()
        modes = {s: module.training for s, module in self.stages.items()}
        try:
            for module in self.stages.values():
                module.eval()
            with torch.no_grad():
                result = engine.step(input_mbs, target_mbs)
        finally:
            for s, module in self.stages.items():
                module.train(modes[s])
            dp = self.data_parallel
            if dp is not None and dp.mode == "shard":  # FSDP gathered them at the forwards
                for module in self.stages.values():
                    module.reshard()  # type: ignore[operator]
        return self._batch_loss(result.loss)

    def _microbatches(self, inputs: Any, targets: Any, caller: str,
                      lengths: Sequence[int] | None = None) -> tuple[list[Any] | None,
                                                                     list[Any] | None]:
        """A step's opening: the inputs (on a rank holding a first stage) and the
        targets (on one holding a last stage) cut into the schedule's microbatches
        (given as such with `lengths`) on this device, else None; the first call
        probes the stages' shapes."""
        if lengths is not None:
            return self._given_microbatches(inputs, targets, lengths)
        m = self.plan.num_microbatches
        input_mbs = target_mbs = None
        if self.is_first:
            if inputs is None:
                raise ValueError(f"rank {self.rank} holds a first stage: {caller} needs the inputs")
            input_mbs = self._to_device(split_microbatches(inputs, m, "the inputs"),
                                        self.param_dtype)
        if self.is_last:
            if targets is None:
                raise ValueError(f"rank {self.rank} holds the last stage: {caller} needs the targets")
            target_mbs = self._to_device(split_microbatches(targets, m, "the targets"))
        if self.specs is None:
            self._probe(input_mbs[0] if input_mbs else None)
        return input_mbs, target_mbs

    def _batch_loss(self, loss: torch.Tensor | None) -> torch.Tensor | None:
        """The batch's mean loss on the last stage's rank, else None: under several
        lanes each lane's last rank holds its microbatches' share, summed here
        (collective over the pipeline)."""
        if self.plan.lanes == 1:
            return loss
        total = loss if loss is not None else torch.zeros((), device=self.device)
        dist.all_reduce(total, group=self.group)
        return total if self.is_last else None

    def _evaluation_engine(self) -> Engine:
        """The engine of the forward-only programs (made at the first `evaluate`):
        the same stages, no hooks, no recompute (nothing is kept for a backward)."""
        if self._eval_engine is None:
            from ppdsl.compiler import compile_forward
            from ppdsl.diagnostics import CompileError, render_all

            try:
                programs = compile_forward(self.plan.forward_schedule()).programs()
            except CompileError as exc:
                raise ScheduleError(render_all(exc.diagnostics, sys.stderr)) from None
            memory = self.plan.memory
            forward_memory = MemoryModel(memory.activation, memory.weight_retained)
            e = self.engine
            self._eval_engine = Engine(
                self.rank, programs[self.rank].ops, self.plan.stage_device,
                self.plan.num_microbatches, forward_memory, self.stages, self.loss_fn, self.device,
                group=self.group, timeout=e.timeout.total_seconds(), release=e.release,
                autocast_dtype=e.autocast_dtype, lane_ends=e.lane_ends,
            )
            assert self.specs is not None
            self._eval_engine.set_specs(self.specs)
        return self._eval_engine

    def _to_device(self, mbs: list[Any], dtype: torch.dtype | None = None) -> list[Any]:
        """`mbs` on this device, their floating-point tensors cast to `dtype` if given."""
        out = []
        for mb in mbs:
            leaves, spec = flatten(mb)
            out.append(unflatten(spec, [
                t.to(self.device, dtype=dtype if dtype is not None and t.is_floating_point()
                     else t.dtype, non_blocking=True) for t in leaves]))
        return out

    def _probe(self, first_input: Any, probe_tokens: int | None = None) -> None:
        """Run microbatch 0 through every stage once, stage by stage, on the rank
        holding it, each later stage on zeros of the previous one's output; every
        rank learns each stage's output structure (or the first error, the same on
        every rank: raised as ModelError). Under a split schedule the forward keeps
        its graph, to name the parameters the split does not cover."""
        specs: dict[int, Spec] = {}
        split = self.plan.split_backward
        engine = self.engine
        num_stages = self.plan.num_stages
        for s in range(num_stages):
            owner = self.plan.stage_device[s]
            payload: list[Any] = [None]
            if owner == self.rank:
                prev = specs.get(s - 1)
                first = self.plan.is_lane_first(s)
                try:
                    if first:
                        value = first_input
                        self._input_spec = flatten(first_input, "the inputs")[1]
                    else:
                        assert prev is not None
                        zeros = []
                        for leaf in prev.leaves():
                            z = torch.zeros(leaf.shape, dtype=leaf.dtype, device=self.device)
                            zeros.append(z.requires_grad_(split and leaf.differentiable))
                        value = unflatten(prev, zeros)
                    # the probe draws nothing from the RNGs the training uses (dropout):
                    # a resumed run continues the same stream as an uninterrupted one
                    devices = [self.device] if self.device.type == "cuda" else []
                    # nor changes the buffers (BatchNorm's statistics), which only
                    # the training's forwards update
                    # nor calls the user's loss: it is called once per microbatch
                    # per step, by the engine (a loss that logs or accumulates
                    # metrics sees only the training's microbatches)
                    with torch.random.fork_rng(devices=devices), kept_buffers(self.stages[s]), \
                            torch.set_grad_enabled(split), engine.autocast():
                        out = call_stage(self.stages[s], value)
                    leaves, spec = flatten(out, f"stage {s}'s output")
                    uncovered = uncovered_in(self.stages[s], leaves) if split else []
                    payload = [(spec, None, uncovered)]
                except Exception as exc:  # the user's model: report, don't crash
                    if not first and prev is not None:
                        shown = (f"of shape {list(prev.leaf.shape)}" if prev.leaf is not None
                                 else str(prev))
                        what = f"stage {s} (on rank {owner}) cannot take stage {s - 1}'s output {shown}"
                    else:
                        what = f"stage {s} (on rank {owner})"
                    kind = "" if isinstance(exc, StructureError) else f"{type(exc).__name__}: "
                    payload = [(None, f"{what}: {kind}{exc}", [])]
            src = global_rank(self.group, owner)
            dist.broadcast_object_list(payload, src=src, group=self.group)
            spec, error, uncovered = payload[0]
            if error is not None:
                raise ModelError(error)
            specs[s] = spec
            if s in self.stages:
                self.uncovered[s] = list(uncovered)
        self.specs = specs
        engine.set_specs(specs, probe_tokens)
        unsplit = [f"stage {s}: {', '.join(n)}" for s, n in sorted(self.uncovered.items()) if n]
        if unsplit:
            self.note(
                f"ppdsl: rank {self.rank}: note: these parameters get their gradient during B "
                f"(no split-aware layer for them): {'; '.join(unsplit)}"
            )

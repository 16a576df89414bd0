"""Data parallelism across pipelines: N replicas of the pipeline on a 2-D device
mesh ("dp", "pp"), each replica on its share of the batch, their gradients
combined at the points the compiled order defines.

Global rank layout (torch's row-major mesh): global rank = dp_index * P + pp_rank,
where P is the schedule's device count. Pipeline rank r of every replica runs
the schedule's rank r; the ranks with the same pp_rank form a DP group.

- `replicate` (DDP's semantics): when a stage's last W (or BW) of the step has
  run, its gradients are final; they are flattened into one bucket and
  all-reduced over the stage's DP group with `async_op=True`, so the reduction
  runs while the rank computes its remaining passes. All buckets are waited for
  (and averaged) after the step's last pass, i.e. before the optimizer step.
- `shard` (FSDP2, `torch.distributed.fsdp.fully_shard` on the DP sub-mesh): the
  stage's parameters are sharded along dim 0; the optimizer holds only the shard
  (DTensors). A 0-dim parameter (a learned scalar) has no dim 0: FSDP leaves it
  whole (`ignored_params`) and it is all-reduced as in `replicate`. The stage is gathered (`unshard`) before its first F of the step
  (the next local stage's gather is started then too, in the background) and
  stays gathered through every microbatch: FSDP's own per-forward reshard and
  per-backward reduce-scatter are switched off (`reshard_after_forward=False`,
  `set_reshard_after_backward(False)`, `set_requires_gradient_sync(False)`).
  The B/W split computes weight gradients outside autograd's backward (W runs
  after B, where FSDP's post-backward hook fires), so FSDP's hook cannot be the
  one that reduces: after the stage's last W the gathered parameters' `.grad`
  hold the whole step's gradient; they are reduce-scattered (one
  `reduce_scatter_tensor`, `async_op=True`) into the shards' layout, the stage
  is resharded at once (`reshard`), and the shards' `.grad` are set (as
  DTensors) after the step's last pass.

In both modes every buffer (BatchNorm's running statistics) is broadcast from
replica 0 after the step's last pass (`ppdsl.runtime.execution.buffers`).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ppdsl.runtime.choices import DP_MODES as MODES
from ppdsl.runtime.execution.buffers import broadcast_buffers
from ppdsl.runtime.execution.dtensor import is_sharded, local_tensor, sharded_like
from ppdsl.runtime.execution.group import global_rank
from ppdsl.runtime.execution.transport import backend_for

__all__ = ["MODES", "DataParallel", "broadcast_replica_zero", "dp_pp_mesh", "shard_stages"]


def _fsdp() -> Any:
    """torch's FSDP2 `fully_shard` (public in torch.distributed.fsdp from torch 2.6;
    torch.distributed._composable.fsdp before)."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # pragma: no cover - torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard  # type: ignore[no-redef]
    return fully_shard


def _reduce_scatter(output: torch.Tensor, source: torch.Tensor, **kwargs: Any) -> Any:
    """torch's reduce-scatter of one tensor: `reduce_scatter_single` where it exists
    (torch 2.13 deprecates `reduce_scatter_tensor` for it), else `reduce_scatter_tensor`."""
    call = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return call(output, source, **kwargs)


def dp_pp_mesh(dp: int, pp: int, device_type: str) -> Any:
    """The 2-D mesh ("dp", "pp") over the world (dp * pp ranks; rank = dp_index * pp
    + pp_rank)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world != dp * pp:
        raise ValueError(f"--dp {dp} x {pp} pipeline ranks needs {dp * pp} processes, not {world}")
    return init_device_mesh(device_type, (dp, pp), mesh_dim_names=("dp", "pp"))


def broadcast_replica_zero(modules: dict[int, nn.Module], dp_group: dist.ProcessGroup) -> None:
    """Every replica starts from replica 0's parameters and buffers (as DDP does)."""
    src = global_rank(dp_group, 0)
    with torch.no_grad():
        for _, module in sorted(modules.items()):
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t.data, src=src, group=dp_group)


def _mixed_precision(param_dtype: torch.dtype | None) -> Any:
    """FSDP2's MixedPrecisionPolicy gathering the stage in `param_dtype` (None:
    none). FSDP's own reduction is switched off here (`DataParallel` reduces in
    its `reduce_dtype`), so the policy's reduce dtype is `param_dtype`: FSDP
    then leaves the gathered gradients where autograd put them (with another
    one it moves them to a buffer of its own at each backward's end, out of
    reach of the W passes that run after it)."""
    if param_dtype is None:
        return None
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy
    except ImportError:  # pragma: no cover - torch < 2.6
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy  # type: ignore[no-redef]
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=param_dtype)


def shard_stages(stages: dict[int, nn.Module], dp_mesh: Any, *,
                 param_dtype: torch.dtype | None = None) -> None:
    """Wrap every stage with FSDP2 on `dp_mesh`, its gathers and reductions left to
    `DataParallel` (module docstring); with `param_dtype`, under FSDP2's
    MixedPrecisionPolicy: the shards keep the model's dtype (fp32: the master
    weights the optimizer steps), a gathered stage is `param_dtype`."""
    fully_shard = _fsdp()
    policy = _mixed_precision(param_dtype)
    # FSDP2 warns when a stage returns a view (an in-place op on it would skip its
    # pre-backward gather); the stage stays gathered from its first F to its last
    # W here, so that gather is never needed.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    for module in stages.values():
        # FSDP2 shards along dim 0, which a 0-dim parameter (a learned scalar) lacks:
        # such a parameter stays whole on every replica and is all-reduced as in
        # replicate mode (`DataParallel.reduce`).
        scalars = {p for p in module.parameters() if p.dim() == 0}
        # FSDP2 refuses a non-contiguous parameter (a transposed weight): its values
        # are laid out afresh, row-major, before it is sharded
        for p in module.parameters():
            if not p.is_contiguous():
                p.data = p.data.contiguous()
        fully_shard(module, mesh=dp_mesh, reshard_after_forward=False,
                    ignored_params=scalars or None,
                    **({"mp_policy": policy} if policy is not None else {}))
        for api in ("set_requires_gradient_sync", "set_reshard_after_backward", "unshard", "reshard"):
            if not hasattr(module, api):  # pragma: no cover - an FSDP2 older than torch 2.5
                raise RuntimeError(f"--dp-mode shard needs FSDP2's {api} (torch >= 2.5); "
                                   f"this torch {torch.__version__} lacks it")
        module.set_requires_gradient_sync(False)  # type: ignore[operator]
        module.set_reshard_after_backward(False)  # type: ignore[operator]


@dataclass
class _Reduction:
    """One stage's gradients in flight."""

    stage: int
    work: Any
    buffer: torch.Tensor
    targets: Sequence[tuple[torch.Tensor, Any]] = field(default_factory=list)
    """All-reduced: (grad, None) per parameter; reduce-scattered: (sharded
    parameter, rows per shard) per parameter."""
    sharded: bool = False
    """Reduce-scattered into shards (shard mode), else all-reduced whole (its
    buffer ends with one flag per parameter: how many replicas had a gradient)."""
    flags: torch.Tensor | None = None
    """Reduce-scattered: per parameter, how many replicas had a gradient."""
    flags_work: Any = None


class DataParallel:
    """Combines the gradients of a `PipelineRunner`'s stages over their DP group at
    the points of its compiled order, through the runner's hooks.

    `mode`: "replicate" or "shard" (the stages already `shard_stages`-wrapped).
    `dp_mesh`: the 1-D "dp" sub-mesh. `stages`: this rank's stage modules.
    `grads_final`: per stage, the index in this rank's ops of its last W/BW
    (`Engine.grads_final`); a parameter shared by two local stages is reduced with
    the later one. `first_forward`: per stage, the index of its first F.
    `reduce_dtype`: the dtype gradients are reduced in (None: their own); the
    result is put back in each gradient's dtype (a shard's: fp32)."""

    def __init__(
        self,
        mode: str,
        dp_mesh: Any,
        stages: dict[int, nn.Module],
        grads_final: dict[int, int],
        first_forward: dict[int, int],
        *,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"dp mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.mode = mode
        self.reduce_dtype = reduce_dtype
        self.mesh = dp_mesh
        self.group = dp_mesh.get_group()
        """The DP group of this rank's pipeline rank."""
        self.size = dist.get_world_size(self.group)
        self.stages = stages
        self._gather_order = sorted(first_forward, key=first_forward.__getitem__)
        owner: dict[int, int] = {}
        for s in sorted(stages, key=lambda s: grads_final.get(s, -1)):
            for p in stages[s].parameters():
                owner[id(p)] = s
        self._params: dict[int, list[tuple[str, nn.Parameter]]] = {
            s: [(n, p) for n, p in module.named_parameters() if owner.get(id(p)) == s]
            for s, module in stages.items()
        }
        self._pending: list[_Reduction] = []
        self._gathers: dict[int, Any] = {}
        self._waited = 0.0
        self._stalls: list[tuple[Any, Any]] = []
        # NCCL's wait blocks the stream, not the CPU: time it on the stream
        self._stream_waits = backend_for(self.group, torch.device("cuda")) == "nccl" and any(
            p.is_cuda for module in stages.values() for p in module.parameters())
        self.on_gather: list[Any] = []
        """Callbacks with a stage's gathered parameters (the memory meter's)."""
        self.gathered_dtypes: set[torch.dtype] = set()
        """shard: the dtypes the gathered stages' parameters had (FSDP2's
        `param_dtype`: what the passes compute with)."""

    @property
    def wait_time(self) -> float:
        """Seconds this rank spent waiting for its collectives (a gather not done
        by its stage's first F, reductions not done after the last pass): the
        exposed communication, summed over steps. On CUDA a wait blocks the
        stream, not the CPU: it is the stream's stall, by CUDA events."""
        for start, end in self._stalls:
            end.synchronize()
            self._waited += start.elapsed_time(end) / 1e3
        self._stalls.clear()
        return self._waited

    @contextlib.contextmanager
    def _timed_wait(self) -> Iterator[None]:
        if self._stream_waits:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._stalls.append((start, end))
            return
        t0 = time.perf_counter()
        yield
        self._waited += time.perf_counter() - t0

    # -- the hooks -------------------------------------------------------------

    def attach(self, hooks: Any) -> None:
        """Put this layer's callbacks on a runner's `Hooks`."""
        hooks.stage_grads_ready.append(self.reduce)
        hooks.after_passes.insert(0, self.finish)
        if self.mode == "shard":
            hooks.before_first_pass.append(self.prefetch_first)
            hooks.before_stage_forward.append(self.gather)

    def prefetch_first(self) -> None:
        """shard: start gathering the first stage this rank runs."""
        if self._gather_order:
            self._start_gather(self._gather_order[0])

    def _start_gather(self, stage: int) -> None:
        if stage not in self._gathers:
            self._gathers[stage] = self.stages[stage].unshard(async_op=True)  # type: ignore[operator]

    def gather(self, stage: int) -> None:
        """shard: before `stage`'s first F, its parameters are whole; the next
        local stage's gather starts in the background."""
        self._start_gather(stage)
        handle = self._gathers[stage]
        if handle is not None:
            with self._timed_wait():
                handle.wait()
        at = self._gather_order.index(stage)
        if at + 1 < len(self._gather_order):
            self._start_gather(self._gather_order[at + 1])
        gathered = list(self.stages[stage].parameters())
        self.gathered_dtypes.update(p.dtype for p in gathered)
        for callback in self.on_gather:
            callback(gathered)

    def reduce(self, stage: int) -> None:
        """After `stage`'s last W/BW: start the reduction of its gradients.

        Every trainable parameter takes part on every replica, with zeros where
        this replica's microbatches left it without a gradient (a branch some
        data skips), and a flag each: one that no replica gave a gradient keeps
        `.grad` None, as a non-pipelined run on the whole batch would."""
        params = [(n, p) for n, p in self._params.get(stage, []) if p.requires_grad]
        # replicate: every parameter; shard: those FSDP keeps whole (0-dim ones)
        whole = [p for _, p in params if self.mode == "replicate" or not is_sharded(p)]
        if whole:
            dtype = self.reduce_dtype or whole[0].dtype
            flags = torch.tensor([p.grad is not None for p in whole], dtype=dtype,
                                 device=whole[0].device)
            buffer = torch.cat([_grad_or_zeros(p, p).reshape(-1).to(dtype) for p in whole]
                               + [flags])
            work = dist.all_reduce(buffer, group=self.group, async_op=True)
            self._pending.append(_Reduction(stage, work, buffer, [(p, None) for p in whole]))
        if self.mode == "shard":
            self._reduce_scatter(stage, [(n, p) for n, p in params if is_sharded(p)])

    def _reduce_scatter(self, stage: int, params: Sequence[tuple[str, nn.Parameter]]) -> None:
        """shard: reduce-scatter the gathered gradients of `stage`'s sharded
        parameters into their shards' layout (their flags all-reduced beside);
        reshard the stage."""
        module = self.stages[stage]
        blocks: list[list[torch.Tensor]] = [[] for _ in range(self.size)]
        targets = []
        present = []
        for name, sharded in params:
            whole = module.get_parameter(name)  # the gathered parameter, between unshard and reshard
            present.append(whole.grad is not None)
            grad = _grad_or_zeros(whole, whole.detach())
            rows = -(-grad.shape[0] // self.size) if grad.dim() else 1
            flat = grad.reshape(grad.shape[0] if grad.dim() else 1, -1)
            padded = torch.zeros((rows * self.size, flat.shape[1]),
                                 dtype=self.reduce_dtype or grad.dtype, device=grad.device)
            padded[: flat.shape[0]] = flat
            for r, block in enumerate(padded.split(rows)):
                blocks[r].append(block.reshape(-1))
            targets.append((sharded, rows))
            whole.grad = None
        self._gathers.pop(stage, None)
        if targets:
            source = torch.cat([torch.cat(b) for b in blocks])
            buffer = torch.empty(source.numel() // self.size, dtype=source.dtype, device=source.device)
            work = _reduce_scatter(buffer, source, group=self.group, async_op=True)
            flags = torch.tensor(present, dtype=source.dtype, device=source.device)
            flags_work = dist.all_reduce(flags, group=self.group, async_op=True)
            self._pending.append(_Reduction(stage, work, buffer, targets, sharded=True,
                                            flags=flags, flags_work=flags_work))
        module.reshard()  # type: ignore[operator]

    def finish(self) -> None:
        """After the last pass: wait for every reduction, average over the DP group
        and put the gradients in place (shard: on the shards, as DTensors)."""
        pending, self._pending = self._pending, []
        with self._timed_wait():
            for r in pending:
                r.work.wait()
                if r.flags_work is not None:
                    r.flags_work.wait()
        for r in pending:
            r.buffer.div_(self.size)
            offset = 0
            if not r.sharded:
                flags = r.buffer[len(r.buffer) - len(r.targets):]
                for (param, _), flag in zip(r.targets, flags.tolist(), strict=True):
                    n = param.numel()
                    piece = r.buffer[offset: offset + n].view_as(param)
                    offset += n
                    if not flag:  # no replica's microbatches used it
                        continue
                    if param.grad is None:
                        param.grad = piece.to(param.dtype, copy=True)
                    else:
                        param.grad.copy_(piece)
                continue
            assert r.flags is not None
            for (sharded, rows), flag in zip(r.targets, r.flags.tolist(), strict=True):
                width = _width(sharded.shape) if sharded.dim() else 1
                piece = r.buffer[offset: offset + rows * width]
                offset += rows * width
                if not flag:
                    continue
                if sharded.dim():
                    local_rows = local_tensor(sharded).shape[0]
                    grad = piece.view(rows, *sharded.shape[1:])[:local_rows]
                else:
                    grad = piece.view(())
                self._set_shard_grad(sharded, grad.to(sharded.dtype, copy=True))
        # the replicas' buffers (BatchNorm's statistics, updated on each replica's
        # share) end the step as replica 0's: DDP's broadcast_buffers policy
        broadcast_buffers([m for _, m in sorted(self.stages.items())], self.group)

    def _set_shard_grad(self, sharded: torch.Tensor, local: torch.Tensor) -> None:
        grad = sharded_like(local, sharded)
        if sharded.grad is None:
            sharded.grad = grad
        else:
            sharded.grad += grad


def _grad_or_zeros(param: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`param`'s gradient, or zeros shaped like `like` where it has none."""
    return param.grad if param.grad is not None else torch.zeros_like(like)


def _width(shape: Sequence[int]) -> int:
    n = 1
    for x in shape[1:]:
        n *= x
    return n

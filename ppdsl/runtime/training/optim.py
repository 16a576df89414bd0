"""The optimizer step of a pipeline: global gradient clipping, inf/NaN checks and
fp16's unscaling, either synchronised or post-validated (zero-bubble paper §4).

Clipping by the global norm and skipping a step whose gradients hold inf or NaN
need state from every rank: the sum of squared gradients and an inf/NaN flag,
all-reduced over the pipeline group (and any group given in `norm_groups`).

- `validation="sync"`: all-reduce, then decide: skip (inf/NaN), clip by
  max_norm / (norm + 1e-6) when that is below 1 (torch.nn.utils.clip_grad_norm_'s
  rule), step. Every rank waits for the slowest one's last pass before stepping.
- `validation="post"`: each rank starts the all-reduce in the background
  (async_op=True) and steps at once with its own gradients, keeping what it needs
  to undo the step; `resolve` (run before the next step's first pass uses the
  weights, through the runner's `before_first_pass` hook) waits for the result and
  then accepts the step, or rolls it back in place and skips it (inf/NaN), or
  rolls it back and redoes it with clipped gradients. The outcome equals sync's.

What post-validation keeps to undo a step: a copy of every parameter that has a
gradient and of its optimizer state, taken just before the step (SGD: 1x the
parameters' bytes, plus 1x with momentum; Adam/AdamW: 3x), and the step's
gradients themselves until they are validated (zero them with
`set_to_none=True`, torch's default, so the next step's gradients are new
tensors; an in-place zeroing before validation is detected and refused). The
hyper-parameters of the step (learning rate, ...) are kept too, so an LR scheduler
stepping in between does not change a redone step.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ppdsl.runtime.choices import LR_SCHEDULES, OPTIMIZERS, VALIDATIONS
from ppdsl.runtime.execution import autograd_access as access
from ppdsl.runtime.execution.dtensor import local_tensor
from ppdsl.runtime.execution.precision import MasterWeights

__all__ = [
    "OPTIMIZERS",
    "LR_SCHEDULES",
    "OptimizerStep",
    "StepOutcome",
    "make_optimizer",
    "lr_lambda",
]



def make_optimizer(
    name: str, params: Sequence[torch.nn.Parameter], lr: float, weight_decay: float = 0.0,
    momentum: float = 0.0,
) -> torch.optim.Optimizer:
    """torch.optim's SGD, Adam or AdamW on `params` (none: a rank whose stages hold
    no parameters steps an empty group; torch refuses an empty parameter list).
    Adam and AdamW run fused where torch has the kernel for every parameter
    (`_fusable`)."""
    groups: list[dict[str, Any]] = [{"params": list(params)}]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, weight_decay=weight_decay, momentum=momentum)
    fused = _fusable(groups[0]["params"]) or None
    if name == "adam":
        return torch.optim.Adam(groups, lr=lr, weight_decay=weight_decay, fused=fused)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, fused=fused)
    raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, not {name!r}")


_FUSED_DEVICES = ("cpu", "cuda")
"""Where torch's fused Adam kernel runs."""


def _fusable(params: Sequence[torch.Tensor]) -> bool:
    """Whether Adam can step `params` fused: plain floating-point tensors (no
    DTensor shard) on a device with the kernel. Its one kernel per parameter
    makes no temporary, where torch's default on CPU (a loop over the
    parameters) makes two of the parameter's size for the denominator
    (sqrt, then a division): 1 GiB beside a 151936x896 embedding, the largest
    transient of a rank holding it (bench/results/real_size.md). Updates differ
    from the loop's by float rounding (a few ULP)."""
    return bool(params) and all(
        type(p) in (torch.Tensor, torch.nn.Parameter) and p.is_floating_point()
        and p.device.type in _FUSED_DEVICES for p in params)


def lr_lambda(schedule: str, total_steps: int, warmup_steps: int = 0,
              min_ratio: float = 0.0) -> Callable[[int], float]:
    """The factor on the base learning rate at each step, for
    torch.optim.lr_scheduler.LambdaLR: constant, or a linear warm-up over
    `warmup_steps` then a cosine decay to `min_ratio` at `total_steps`."""
    if schedule == "constant":
        return lambda step: 1.0
    if schedule != "warmup-cosine":
        raise ValueError(f"lr schedule must be one of {', '.join(LR_SCHEDULES)}, not {schedule!r}")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(total_steps - warmup_steps, 1)
        progress = min((step - warmup_steps) / span, 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


@dataclass(frozen=True)
class StepOutcome:
    """What became of one optimizer step."""

    step: int
    """Which call of `OptimizerStep.step` (from 0)."""
    grad_norm: float
    """The global gradient norm (after unscaling); inf or NaN when invalid."""
    skipped: bool
    """Some gradient on some rank was inf or NaN: the step was not applied."""
    clipped: bool
    """The gradients were scaled by max_norm / (norm + 1e-6)."""
    rolled_back: bool
    """post: the optimistic step was undone (then skipped, or redone clipped)."""


class _Pending:
    """A post-validated step awaiting its global check."""

    def __init__(self) -> None:
        self.work: Any = None
        self.reduced: torch.Tensor | None = None
        self.stepped = False
        self.params: list[torch.nn.Parameter] = []
        self.grads: list[torch.Tensor] = []
        self.versions: list[int] = []
        self.values: list[torch.Tensor] = []
        self.state: dict[torch.nn.Parameter, dict[str, Any]] = {}
        self.hyper: list[dict[str, Any]] = []


class OptimizerStep:
    """The optimizer step of `runner`'s rank, validated across the pipeline.

    `optimizer`: any torch.optim optimizer over (some of) `runner.parameters()`.
    `max_norm`: clip by the global gradient norm (None: no clipping; inf/NaN steps
    are still skipped). `validation`: "sync" or "post" (module docstring).
    `norm_groups`: the process groups the norm and flags are summed over (default:
    the runner's `norm_groups`: its pipeline group, plus its DP group in shard
    mode, where each rank holds a shard of the gradients).
    `norm_parameters`: whose gradients count in the norm (default:
    `runner.norm_parameters()`, each tied parameter once). With fp16 the runner's
    loss scaler is unscaled and updated here. `master`: the fp32 master weights
    of parameters kept in bf16 (`ppdsl.runtime.execution.precision.MasterWeights`),
    when the optimizer holds those: each step takes the gradients onto them
    first, and every change to them (a step, a roll-back) is copied back."""

    def __init__(
        self,
        runner: Any,
        optimizer: torch.optim.Optimizer,
        *,
        max_norm: float | None = None,
        validation: str = "sync",
        norm_groups: Sequence[dist.ProcessGroup | None] | None = None,
        norm_parameters: Sequence[torch.nn.Parameter] | None = None,
        master: MasterWeights | None = None,
    ) -> None:
        if validation not in VALIDATIONS:
            raise ValueError(f"validation must be 'sync' or 'post', not {validation!r}")
        if max_norm is not None and not max_norm > 0:
            raise ValueError(f"max_norm must be positive, not {max_norm}")
        self.runner = runner
        self.optimizer = optimizer
        self.max_norm = max_norm
        self.validation = validation
        self.norm_groups = list(norm_groups) if norm_groups is not None else \
            list(getattr(runner, "norm_groups", [runner.group]))
        self.master = master
        """The fp32 master weights the optimizer steps, or None."""
        counted = norm_parameters if norm_parameters is not None else runner.norm_parameters()
        self._norm_ids = {id(master.of(p) if master is not None else p) for p in counted}
        self.scaler = runner.scaler
        self.device = runner.device
        self.steps = 0
        """Calls of `step` so far."""
        self.outcomes: list[StepOutcome] = []
        """Every resolved step's outcome, in order."""
        self._pending: _Pending | None = None
        runner.hooks.before_first_pass.insert(0, self.resolve)

    def _params(self) -> list[torch.nn.Parameter]:
        seen: dict[int, torch.nn.Parameter] = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                seen.setdefault(id(p), p)
        return list(seen.values())

    def _local(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """[sum of squared gradient norms, count of non-finite norms] on this rank."""
        grads = [p.grad for p in params if p.grad is not None and id(p) in self._norm_ids]
        if not grads:
            return torch.zeros(2, dtype=torch.float64, device=self.device)
        grads = [local_tensor(g) for g in grads]  # a sharded gradient: this rank's shard
        norms = torch.stack([n.double() for n in access.foreach_norm(grads, 2.0)])
        return torch.stack([(norms * norms).sum(), (~torch.isfinite(norms)).sum().double()])

    def _clip_coef(self, norm: float) -> float | None:
        if self.max_norm is None:
            return None
        coef = self.max_norm / (norm + 1e-6)
        return coef if coef < 1.0 else None

    @torch.no_grad()
    def step(self) -> StepOutcome | None:
        """Step the optimizer with this step's gradients (call after
        `runner.step`). sync: returns the outcome; post: steps optimistically and
        returns None (the outcome comes with `resolve`)."""
        self.resolve()  # a step not yet validated (no runner.step in between)
        if self.master is not None:
            self.master.take_gradients()
        params = [p for p in self._params() if p.grad is not None]
        if self.scaler is not None:
            self.scaler.unscale_([p.grad for p in params])  # type: ignore[misc]
        local = self._local(params)
        index = self.steps
        self.steps += 1
        if self.validation == "sync":
            for group in self.norm_groups:
                dist.all_reduce(local, group=group)
            return self._finish(index, local, params, None)
        pending = _Pending()
        locally_finite = float(local[1]) == 0  # read before the reduction overwrites it
        pending.reduced = local
        pending.work = dist.all_reduce(local, group=self.norm_groups[0], async_op=True)
        pending.params = params
        pending.grads = [p.grad for p in params]  # type: ignore[misc]
        pending.versions = [access.version(g) for g in pending.grads]
        if locally_finite:  # step now, keeping what undoes it
            with torch.no_grad():
                pending.values = [p.detach().clone() for p in params]
            pending.state = {
                p: {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                    for k, v in self.optimizer.state[p].items()}
                for p in params if p in self.optimizer.state
            }
            pending.hyper = [{k: v for k, v in g.items() if k != "params"}
                             for g in self.optimizer.param_groups]
            self._optimizer_step()
            pending.stepped = True
        self._pending = pending
        return None

    @torch.no_grad()
    def resolve(self) -> StepOutcome | None:
        """post: wait for the pending step's global norm and flags; accept it, or
        roll it back in place and skip or redo it clipped. Runs by itself before
        the runner's next first pass; call it before reading the weights otherwise
        (the end of training, a checkpoint). Nothing to do: None."""
        pending = self._pending
        if pending is None:
            return None
        self._pending = None
        pending.work.wait()
        assert pending.reduced is not None
        for group in self.norm_groups[1:]:
            dist.all_reduce(pending.reduced, group=group)
        return self._finish(self.steps - 1, pending.reduced, pending.params, pending)

    def _finish(self, index: int, reduced: torch.Tensor, params: list[torch.nn.Parameter],
                pending: _Pending | None) -> StepOutcome:
        sumsq, bad = float(reduced[0]), float(reduced[1])
        norm = math.sqrt(sumsq) if sumsq >= 0 else float("nan")
        invalid = bad > 0 or not math.isfinite(norm)
        coef = None if invalid else self._clip_coef(norm)
        rolled_back = False
        if pending is None:  # sync
            if not invalid:
                if coef is not None:
                    access.foreach_mul_([p.grad for p in params], coef)  # type: ignore[misc]
                self._optimizer_step()
        elif invalid or coef is not None:
            if pending.stepped:
                self._roll_back(pending)
                rolled_back = True
            if not invalid:
                self._redo(pending, coef)  # type: ignore[arg-type]
        if self.scaler is not None:
            self.scaler.update(invalid)
        outcome = StepOutcome(index, norm, invalid, coef is not None, rolled_back)
        self.outcomes.append(outcome)
        return outcome

    def _optimizer_step(self) -> None:
        self.optimizer.step()
        if self.master is not None:
            self.master.copy_back()

    def _roll_back(self, pending: _Pending) -> None:
        with torch.no_grad():
            for p, value in zip(pending.params, pending.values, strict=True):
                p.copy_(value)
            if self.master is not None:
                self.master.copy_back()
        state = self.optimizer.state
        for p in pending.params:
            before = pending.state.get(p)
            if before is None:
                state.pop(p, None)  # the step created it
                continue
            now = state[p]
            for k in list(now):
                if k not in before:
                    del now[k]
            for k, v in before.items():
                cur = now.get(k)
                if isinstance(v, torch.Tensor) and isinstance(cur, torch.Tensor) and cur.shape == v.shape:
                    cur.copy_(v)
                else:
                    now[k] = v

    def _redo(self, pending: _Pending, coef: float) -> None:
        changed = [i for i, (g, v) in enumerate(zip(pending.grads, pending.versions, strict=True))
                   if access.version(g) != v]
        if changed:
            raise RuntimeError(
                "post-validation: the gradients of the step being redone were changed in place "
                "before they were validated (zero_grad(set_to_none=False)?); zero gradients with "
                "set_to_none=True (the default) under --optimizer-validation post"
            )
        current = [p.grad for p in pending.params]
        hyper_now = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        for group, hyper in zip(self.optimizer.param_groups, pending.hyper, strict=True):
            group.update(hyper)
        try:
            access.foreach_mul_(pending.grads, coef)
            for p, g in zip(pending.params, pending.grads, strict=True):
                p.grad = g
            self._optimizer_step()
        finally:
            for p, now in zip(pending.params, current, strict=True):
                p.grad = now
            for group, hyper in zip(self.optimizer.param_groups, hyper_now, strict=True):
                group.update(hyper)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (resolve first: nothing may be pending)."""
        if self._pending is not None:
            raise RuntimeError("OptimizerStep.state_dict with a step still pending: resolve() first")
        return {"steps": self.steps,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`'s values."""
        self.steps = int(state["steps"])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])

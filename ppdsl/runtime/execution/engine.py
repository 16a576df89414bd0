"""One rank's passes of one step: run its RankProgram's ops in order.

- F(mb, s): the stage's forward on the received (or locally handed-over) value;
  on the last stage also the loss, scaled by 1/m (and by the loss scale under
  fp16) so that gradients summed over microbatches are those of the batch's mean
  loss (by its weight instead where a step gives them: documents' targets over
  the step's, the loss per token). Under bf16/fp16 the forward and the loss run
  under autocast, whose weight casts are made once per step: the step runs
  inside one (disabled) autocast region, so autocast's cast cache lives until
  the step ends and every microbatch's graph shares one low-precision copy of
  each weight (not one per microbatch in flight).
- B(mb, s): the stage's input gradients; the split layers' weight-gradient work
  goes into a W stash (`ppdsl.runtime.execution.split.backward_input`); the graph is freed.
- W(mb, s): runs the stash: weight gradients only.
- BW(mb, s): one backward computing both.
- Recompute (activation checkpointing) on a stage marked `recompute`: its F runs
  the stage under `torch.no_grad()`, so it keeps only its input (and the RNG
  state), and hands its output on; R(mb, s) runs the stage again on that input
  with autograd on, the CPU and CUDA RNG states restored under
  `torch.random.fork_rng` (torch.utils.checkpoint's recomputation: dropout draws
  the same masks), which leaves exactly the graph and saved activations an
  ordinary F would; B/BW/W then run on it unchanged.
- Exchange: posts its sends and receives through the rank's `Transport`
  (`ppdsl.runtime.execution.transport`, chosen from the tensors' device): on gloo (and
  when ranks share a GPU, staged through host memory) also the receives of the
  *next* exchange, so their data arrives while this rank computes the pass in
  between (gloo matches by tag, one tag per tensor of a transfer, so posting
  early is safe); on NCCL, which matches in order, an exchange is one
  batch_isend_irecv, as lowered and checked for deadlock. A receive is waited
  for where its tensor is first used (the pass that takes it); sends finish in
  the background, their tensors kept alive, and are collected at later
  exchanges and at the step's end: no exchange stalls compute on its sends.
  Two stages on one rank hand over without a transfer; a step given each
  microbatch's tokens moves each transfer at the shape they give, checked by
  its sender (`ppdsl.runtime.execution.shapes`).

A value between stages is a tensor or a tuple/list/dict of tensors
(`ppdsl.runtime.execution.structure`); each tensor moves on its own, floating-point ones
carry a gradient back. Ranks are the pipeline group's ranks (`group`); point-to-
point calls name the global ranks behind them.

Hooks (`Hooks`) let a layer above (post-validation, data parallelism, ties) act
at the points a step defines: before this rank's first pass, before a stage's
first forward, when a stage's gradients are final (its last W or BW of the
step), and after the last pass. Each pass runs as hooks, wait, compute, hooks;
which hooks are due and which receive a pass takes are decided once from the
order (`OpPlan`), not per pass (host work a GPU would wait on:
`ppdsl.runtime.measure.hostops` counts it); what is recorded around a pass
(trace, timing, memory windows) is one `PassInstruments`, and everything a step
holds is one `StepState` made per step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist

from ppdsl.ir.rank import Compute, Exchange, Op, Transfer, TransferKind
from ppdsl.ir.schedule import MemoryModel, PassKind
from ppdsl.runtime.choices import RELEASES
from ppdsl.runtime.errors import LossError, PeerError, first_line, peer_failure
from ppdsl.runtime.execution.buffers import kept_buffers
from ppdsl.runtime.execution.group import LaneEnds, global_rank, transfer_tag
from ppdsl.runtime.execution.instruments import PassInstruments
from ppdsl.runtime.execution.memory import DevicePeak, MemoryMeter
from ppdsl.runtime.execution.op_plan import op_plans, stage_points
from ppdsl.runtime.execution.shapes import TokenShapes
from ppdsl.runtime.execution.split import WStash, backward_input
from ppdsl.runtime.execution.step_state import Kept, Key, RngState, Saved, StepState
from ppdsl.runtime.execution.structure import Spec, call_stage, flatten, unflatten
from ppdsl.runtime.execution.trace import Tracer
from ppdsl.runtime.execution.transport import Transport
from ppdsl.runtime.worker import faults, progress

__all__ = ["Engine", "Hooks", "PeerError", "StepResult"]

_NOTHING = contextlib.nullcontext()
"""One do-nothing context for every pass that needs none (reentrant): not one
made per pass."""


@dataclass
class StepResult:
    """What one step measured on this rank."""

    loss: torch.Tensor | None
    """The batch's mean loss, detached and unscaled (on the rank holding the last
    stage), else None."""
    step_time: float
    """Seconds from the first op to the last send completed."""
    compute_time: float
    """Seconds inside passes (on CUDA the GPU's time, by CUDA events: a pass's
    CPU time there is only its kernels' launch)."""


@dataclass
class Hooks:
    """Callbacks at the points of a step (each list runs in order)."""

    before_first_pass: list[Callable[[], None]] = field(default_factory=list)
    """Before this rank's first compute pass of the step, i.e. before anything
    uses the weights (post-validation resolves the previous step here)."""
    before_stage_forward: list[Callable[[int], None]] = field(default_factory=list)
    """Before a stage's first F of the step, with the stage index (e.g. a sharded
    data-parallel layer gathers the stage's weights)."""
    stage_grads_ready: list[Callable[[int], None]] = field(default_factory=list)
    """After a stage's last W or BW of the step, with the stage index: its weight
    gradients are final (e.g. a data-parallel layer starts their all-reduce)."""
    after_passes: list[Callable[[], None]] = field(default_factory=list)
    """After the last pass and after every send has completed."""


class Engine:
    """Runs one rank's ops on its stages."""

    def __init__(
        self,
        rank: int,
        ops: Sequence[Op],
        stage_device: Sequence[int],
        num_microbatches: int,
        memory: MemoryModel,
        stages: dict[int, torch.nn.Module],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        device: torch.device,
        *,
        group: dist.ProcessGroup | None = None,
        timeout: float = 60.0,
        release: str = "at-b",
        autocast_dtype: torch.dtype | None = None,
        lane_ends: LaneEnds,
        transport: Transport | None = None,
    ) -> None:
        if release not in RELEASES:
            raise ValueError(f"release must be 'at-b' or 'at-w', not {release!r}")
        self.rank = rank
        self.release = release
        """When a split backward frees a microbatch-stage's activations: "at-b" (B
        frees all but the layer inputs its W needs) or "at-w" (the whole autograd graph
        is kept until W, as torch.distributed.pipelining's split does and as the
        controllable-memory paper counts: M_W = M_B)."""
        self.ops = ops
        self.stage_device = tuple(stage_device)
        self.num_stages = len(stage_device)
        self.lane_ends = lane_ends
        """Each lane's first stage (it reads the inputs) and last (it computes the
        loss), from the plan (`ppdsl.runtime.execution.group.LaneEnds`)."""
        self.num_microbatches = num_microbatches
        self.memory = memory
        self.stages = stages
        self.loss_fn = loss_fn
        self.device = device
        self.group = group
        self.autocast_dtype = autocast_dtype
        self.specs: dict[int, Spec] = {}
        """{stage: spec of its output}, from the probe (`ppdsl.runtime.execution.pipeline`)."""
        self.timeout = timedelta(seconds=timeout)
        self.transport = transport if transport is not None else Transport(group, device)
        """How this rank's tensors move (`ppdsl.runtime.execution.transport`): decided from the
        tensors' device, not from the group's reported backend name."""
        self.hooks = Hooks()
        self._global = [global_rank(group, r) for r in range(dist.get_world_size(group))]
        params: dict[int, torch.nn.Parameter] = {}
        for module in stages.values():
            for param in module.parameters():
                params.setdefault(id(param), param)
        self.params = list(params.values())
        self.recompute = memory.recompute
        """The stages marked `recompute`: their F keeps only its input, R restores."""
        self.meter = MemoryMeter(self.params)
        self.device_peak: DevicePeak | None = DevicePeak(self.device) if self.device.type == "cuda" else None
        """The allocator's peak on CUDA (None elsewhere): a measured step also
        records each pass's working memory in it (`DevicePeak.pass_window`)."""
        self.compute_time: dict[PassKind, float] = {k: 0.0 for k in PassKind}
        self.tracer: Tracer | None = None
        """When set, every pass, exchange and optimizer step is recorded in it."""
        self._num_leaves = 1
        self.sent_bytes = 0  # to other stages' ranks, at true sizes: proves no padding
        self._shapes = TokenShapes(None)
        """The shape rule when microbatches vary in tokens (`set_specs`)."""
        self._current = StepState(None, None, None, False)
        """The running step's state (`StepState`); an empty one between steps."""

    @property
    def ops(self) -> tuple[Op, ...]:
        """This rank's order; setting it decides each op's plan again, once
        (`op_plan`: no per-pass decisions a GPU would wait on)."""
        return self._ops

    @ops.setter
    def ops(self, ops: Sequence[Op]) -> None:
        self._ops = tuple(ops)
        self._first_forward, self._grads_final = stage_points(self._ops)
        self._first_compute = next(
            (i for i, op in enumerate(self._ops) if isinstance(op, Compute)), None)
        self._plans = op_plans(self._ops, self._first_compute, self._first_forward,
                               self._grads_final)

    @property
    def first_forward(self) -> dict[int, int]:
        """Per stage of this rank: the index in `ops` of its first F."""
        return dict(self._first_forward)

    @property
    def grads_final(self) -> dict[int, int]:
        """Per stage of this rank: the index in `ops` of its last W or BW, after
        which its weight gradients are final (derived from the compiled order)."""
        return dict(self._grads_final)

    def set_specs(self, specs: dict[int, Spec], probe_tokens: int | None = None) -> None:
        """Every stage's output spec (the same on every rank); `probe_tokens`: the
        tokens of the microbatch probed, when they vary (`shapes.TokenShapes`)."""
        self.specs = dict(specs)
        self._shapes = TokenShapes(probe_tokens)
        self._num_leaves = max((len(s.leaves()) for s in specs.values()), default=1) or 1

    def _peer(self, rank: int) -> int:
        return self._global[rank]

    # -- one step ------------------------------------------------------------

    def step(
        self,
        inputs: Sequence[Any] | None,
        targets: Sequence[Any] | None,
        *,
        measure: bool = False,
        loss_scale: torch.Tensor | float | None = None,
        lengths: Sequence[int] | None = None,
        weights: Sequence[float] | None = None,
    ) -> StepResult:
        """One step's passes: `inputs` (on the rank holding stage 0) and `targets`
        (on the rank holding the last stage) are per-microbatch values, else None.
        Gradients accumulate into the parameters' `.grad`. `measure` runs the memory
        meter (its saved-tensor hooks cost Python time on every saved tensor; the
        activations of a step with static shapes are the same every step, so
        measuring one step is enough). `lengths`, `weights`: each microbatch's
        tokens and share of the loss, when they vary (default 1/m)."""
        self._current = StepState(inputs, targets, loss_scale, measure, lengths, weights)
        if measure:
            self.meter.reset_peak()
        start = time.perf_counter()
        instruments = PassInstruments(self.tracer, self.device,
                                   self.device_peak if measure else None, self.compute_time)
        with self._cast_once():
            self._run_ops(instruments)
        if self._first_compute is None:  # a rank with no pass still validates
            for before in self.hooks.before_first_pass:
                before()
        progress.at("completing the step's last sends")
        for pending in self._current.sends:
            self._wait(pending, pending.what)
        self._current.sends.clear()
        for after in self.hooks.after_passes:
            after()
        instruments.finish(self.device)
        elapsed = time.perf_counter() - start
        holds_loss = any(self._is_last(s) for s in self.stages)
        losses = self._current.losses
        loss = torch.stack(losses).sum() if holds_loss and losses else None
        self._current = StepState(None, None, None, False)
        return StepResult(loss, elapsed, instruments.compute)

    def _cast_once(self) -> contextlib.AbstractContextManager[Any]:
        """The step's autocast region (disabled: B and W run without autocast):
        autocast clears its cast cache only when its outermost region ends, so
        the forwards' nested regions share one cast of each weight per step."""
        if self.autocast_dtype is None:
            return _NOTHING
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=False)

    def _run_ops(self, instruments: PassInstruments) -> None:
        """The step's ops in order: an exchange is posted; a pass runs its hooks,
        waits for its receive, computes, and runs its hooks. What each op needs
        beyond the step's state was decided once (`OpPlan`)."""
        hooks = self.hooks
        arriving = self._current.arriving
        for plan in self._plans:
            progress.at(plan.op)
            if plan.exchange is not None:
                with instruments.exchange(plan.exchange):
                    self._exchange(plan.exchange, plan.next_exchange)
                continue
            op = plan.compute
            assert op is not None
            if plan.first_pass:
                for before in hooks.before_first_pass:
                    before()
            if plan.forward_of is not None:
                for before_stage in hooks.before_stage_forward:
                    before_stage(plan.forward_of)
            if plan.arriving is not None and plan.arriving in arriving:
                # its receive, waited for here: not the pass's time
                with instruments.waiting(arriving[plan.arriving][0]):
                    self._receive(plan.arriving)
            with instruments.pass_(op.pass_):
                self._compute(op)
            if plan.final_of is not None:
                for ready in hooks.stage_grads_ready:
                    ready(plan.final_of)

    def _compute(self, op: Compute) -> None:
        p = op.pass_
        key = (p.microbatch, p.stage)
        if p.kind is PassKind.F:
            self._forward(p.microbatch, p.stage)
        elif p.kind is PassKind.R:
            self._recompute(p.microbatch, p.stage)
        elif p.kind is PassKind.W:
            stash = self._current.stash.pop(key)
            stash.run()  # under no_grad, whoever calls it
            if self._current.measure:
                self.meter.set_stash(key, [], [])
        else:
            self._backward(p.microbatch, p.stage, fused=p.kind is PassKind.BW)
        if self._current.measure:
            self.meter.after(
                p.kind, key, self.memory.activation[p.stage], recomputed=p.stage in self.recompute
            )

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The forward's precision context (autocast under bf16/fp16)."""
        if self.autocast_dtype is None:
            return _NOTHING
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _is_first(self, s: int) -> bool:
        return s in self.lane_ends.first

    def _is_last(self, s: int) -> bool:
        return s in self.lane_ends.last

    def _forward(self, mb: int, s: int) -> None:
        faults.reached("forward")
        inputs: list[torch.Tensor] = []
        if self._is_first(s):
            assert self._current.inputs is not None, f"stage {s}'s rank was given no inputs"
            value = self._current.inputs[mb]
        else:
            received = self._take(TransferKind.ACT, mb, s)
            for t in received:
                if t.is_floating_point() or t.is_complex():
                    inputs.append(t.requires_grad_(True))
            value = unflatten(self.specs[s - 1], received)
        if s in self.recompute:
            rng = RngState(self.device)
            with torch.no_grad():
                self._run_stage(mb, s, value, inputs, send=True)
            del self._current.saved[(mb, s)]  # no graph: R makes the one B runs on
            self._current.kept[(mb, s)] = Kept(value, inputs, rng)
            if self._current.measure:
                leaves = flatten(value, f"stage {s}'s input")[0] if self._is_first(s) else received
                self.meter.set_kept((mb, s), [t for t in leaves if isinstance(t, torch.Tensor)])
            return
        self._run_stage(mb, s, value, inputs, send=True)

    def _recompute(self, mb: int, s: int) -> None:
        """R: the stage's forward again on what its F kept, with autograd and the
        F's RNG state, leaving the state B needs; nothing is sent."""
        kept = self._current.kept.pop((mb, s))
        if self._current.measure:
            self.meter.set_kept((mb, s), [])
        with kept.rng.restored(), kept_buffers(self.stages[s]):  # F updated them already
            self._run_stage(mb, s, kept.value, kept.inputs, send=False)

    def _loss(self, mb: int, s: int, out: Any) -> torch.Tensor:
        """The user's loss of microbatch `mb` (once per microbatch and step, R aside:
        recomputing the last stage computes its loss again); LossError when it fails
        or returns no scalar tensor."""
        assert self._current.targets is not None, "the last stage's rank was given no targets"
        try:
            loss = self.loss_fn(out, self._current.targets[mb])
        except Exception as exc:
            raise LossError(f"loss(output, target) of stage {s}, microbatch {mb}: "
                            f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shown = f"shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise LossError(f"loss(output, target) must return a scalar tensor, not {shown} "
                            f"(stage {s}, microbatch {mb})")
        return loss

    def _run_stage(
        self, mb: int, s: int, value: Any, inputs: list[torch.Tensor], *, send: bool
    ) -> None:
        """The stage (and on the last one the loss) on `value`; keeps what B needs
        and, if `send`, hands the output to the next stage (the loss once)."""
        last = self._is_last(s)
        with self.meter.saving((mb, s)) if self._current.measure else _NOTHING:
            with self.autocast():
                out = call_stage(self.stages[s], value)
                if last:
                    loss = self._loss(mb, s, out)
            if last:
                w, m = self._current.weights, self.num_microbatches
                if send:
                    share = loss.detach().float()
                    self._current.losses.append(share / m if w is None else share * w[mb])
                scaled = loss / m if w is None else loss * w[mb]
                if self._current.loss_scale is not None:
                    scaled = scaled * self._current.loss_scale
                self._current.saved[(mb, s)] = Saved(inputs, [0], [scaled])
                return
        leaves, _ = flatten(out, f"stage {s}'s output")
        # The outputs a gradient comes back for: floating-point leaves; B runs from
        # those autograd reaches (a leaf made without gradients gets none).
        floats = [i for i, t in enumerate(leaves) if t.is_floating_point() or t.is_complex()]
        outs = [i for i, t in enumerate(floats) if leaves[t].requires_grad]
        self._current.saved[(mb, s)] = Saved(inputs, outs, [leaves[floats[i]] for i in outs])
        if send:
            self._give(TransferKind.ACT, mb, s, s + 1, [t.detach() for t in leaves])

    def _backward(self, mb: int, s: int, fused: bool) -> None:
        saved = self._current.saved.pop((mb, s))
        inputs, outs = saved.inputs, saved.outputs
        if self._is_last(s):
            grads: list[torch.Tensor | None] = [None]
        else:
            received = self._take(TransferKind.GRAD, mb, s)
            grads = [received[i] for i in saved.grad_positions]
        stash = None
        grad_inputs: list[torch.Tensor | None]
        if not outs:  # nothing differentiable left this stage
            grad_inputs = [None] * len(inputs)
        elif fused:
            torch.autograd.backward(outs, grads)
            grad_inputs = [x.grad for x in inputs]
        else:
            stash = WStash()
            hold = self.release == "at-w"
            grad_inputs = backward_input(outs, grads, inputs, stash, retain_graph=hold)
            if hold:
                stash.graph = outs[0]  # the graph and its saved activations live until W
        del outs, grads
        if stash is not None:
            self._current.stash[(mb, s)] = stash
            if self._current.measure:
                self.meter.set_stash((mb, s), stash.tensors, stash.gradients)
        elif not fused:  # a W still comes: give it an empty stash
            self._current.stash[(mb, s)] = WStash()
        if not self._is_first(s):
            self._give(TransferKind.GRAD, mb, s, s - 1, [
                g if g is not None else torch.zeros_like(x) for g, x in zip(grad_inputs, inputs, strict=True)
            ])

    # -- hand-over and transfers ---------------------------------------------

    def _give(self, kind: TransferKind, mb: int, src: int, dst: int, value: list[torch.Tensor]) -> None:
        if self.stage_device[dst] == self.rank:
            self._current.inbox[(kind, mb, dst)] = value  # the V's turn: no transfer
        else:
            if self._current.lengths is not None:
                self._shapes.check(kind, value, self.specs, mb, src, dst,
                                   self._current.lengths[mb], self.stage_device[dst])
            self._current.outbox[(kind, mb, src)] = [v.contiguous() for v in value]

    def _receive(self, key: Key) -> None:
        """Wait for a pending receive; its tensors go to the inbox."""
        t, pending = self._current.arriving.pop(key)
        self._current.inbox[key] = [self._wait(r, t) for r in pending]

    def _take(self, kind: TransferKind, mb: int, stage: int) -> list[torch.Tensor]:
        """The value handed over locally, else the received one: its receives are
        waited for here, where it is first used."""
        key = (kind, mb, stage)
        if key not in self._current.inbox:
            self._receive(key)
        return self._current.inbox.pop(key)

    def _leaves_of(self, t: Transfer) -> list[Any]:
        """The tensors a transfer carries: every leaf of the sender's output for an
        activation, the differentiable ones for a gradient."""
        stage = t.src_stage if t.kind is TransferKind.ACT else t.dst_stage
        leaves = self.specs[stage].leaves()
        return leaves if t.kind is TransferKind.ACT else [x for x in leaves if x.differentiable]

    def _recv_specs(self, t: Transfer) -> list[tuple[torch.Size, torch.dtype, int, int, Transfer]]:
        m, n, k = self.num_microbatches, self.num_stages, self._num_leaves
        tokens = None if self._current.lengths is None else self._current.lengths[t.microbatch]
        return [(self._shapes.expected(leaf.shape, tokens), leaf.dtype, self._peer(t.src_rank),
                 transfer_tag(t, i, m, n, k), t)
                for i, leaf in enumerate(self._leaves_of(t))]

    def _post(self, sends: list[tuple[list[torch.Tensor], Transfer]], recvs: Sequence[Transfer]) -> None:
        """Post `sends` and the receives of `recvs` (as one batch where the transport
        is ordered); the receives wait in `_arriving` for the pass that takes them."""
        m, n, k = self.num_microbatches, self.num_stages, self._num_leaves
        send_specs = [(v, self._peer(t.dst_rank), transfer_tag(t, i, m, n, k), t)
                      for values, t in sends for i, v in enumerate(values)]
        recv_specs = [spec for t in recvs for spec in self._recv_specs(t)]
        self.sent_bytes += sum(v.numel() * v.element_size() for v, _, _, _ in send_specs)
        try:
            pending_sends, pending_recvs = self.transport.post(send_specs, recv_specs)
        except RuntimeError as exc:
            raise PeerError(f"posting the transfers {[str(t) for _, t in sends] + [str(t) for t in recvs]} "
                            f"failed: {exc}") from exc
        self._current.sends += pending_sends
        for r in pending_recvs:
            self._current.posted.setdefault(r.what, []).append(r)

    def _exchange(self, op: Exchange, upcoming: Exchange | None) -> None:
        """Post the sends and receives of `op`; on a tagged transport (gloo: tags
        match transfers, so order does not matter) also the receives of the next
        exchange, so that their data arrives while this rank runs the pass in
        between. Nothing is waited for here: a receive where its tensor is used
        (`_take`), a send lazily."""
        self._current.sends = [s for s in self._current.sends if not s.done()]
        sends = [(self._current.outbox.pop((t.kind, t.microbatch, t.src_stage)), t) for t in op.sends]
        if self.transport.ordered:  # NCCL matches in order: one batch per exchange, as proven
            self._post(sends, op.recvs)
        else:
            early = [t for t in upcoming.recvs] if upcoming is not None else []
            self._post(sends, [t for t in (*op.recvs, *early) if t not in self._current.posted])
        for t in op.recvs:
            self._current.arriving[(t.kind, t.microbatch, t.dst_stage)] = (t, self._current.posted.pop(t, []))
        if op.sends or op.recvs:
            faults.reached("exchange")

    def _wait(self, pending: Any, t: Transfer) -> Any:
        """Wait for a pending send or receive (its value); a failure names the peer."""
        peer = t.src_rank if t.dst_rank == self.rank else t.dst_rank
        running = progress.current()
        progress.at(("receive" if t.dst_rank == self.rank else "send", t))
        try:
            value = pending.wait(self.timeout)
            progress.at(running)  # the pass that waited goes on
            return value
        except RuntimeError as exc:
            what = "receiving" if t.dst_rank == self.rank else "sending"
            cause = peer_failure(exc)
            if cause == "lost":
                why = f"the connection to rank {peer} was lost (rank {peer} died)"
            elif cause == "silent":
                why = (f"rank {peer} did not answer within "
                       f"{self.timeout.total_seconds():g} s (hung or deadlocked)")
            else:
                why = f"rank {peer} failed ({first_line(exc, 200)})"
            raise PeerError(f"{what} {t}: {why}") from exc

    # -- results ---------------------------------------------------------------

    def measured_mw_ratio(self) -> dict[int, Fraction]:
        """Per stage of this rank: bytes held after B / bytes held after F."""
        ratios: dict[int, Fraction] = {}
        for (mb, s), after in self.meter.after_b.items():
            f = self.meter.f_bytes.get((mb, s))
            if f:
                ratios.setdefault(s, Fraction(after, f))
        return ratios

    def measured_mi_ratio(self) -> dict[int, Fraction]:
        """Per recomputed stage of this rank: bytes its F keeps / bytes after its R
        (the model's real M_I / M_B)."""
        ratios: dict[int, Fraction] = {}
        for (mb, s), kept in self.meter.kept_bytes.items():
            full = self.meter.f_bytes.get((mb, s))
            if full:
                ratios.setdefault(s, Fraction(kept, full))
        return ratios

    def stage_bytes(self) -> dict[int, int]:
        """Per stage of this rank: the bytes of one microbatch's activations (1 M_B)."""
        found: dict[int, int] = {}
        for (_mb, s), b in self.meter.f_bytes.items():
            found.setdefault(s, b)
        return found

"""One rank's training step: run its RankProgram's ops in order.

- F(mb, s): the stage's forward on the received (or locally handed-over)
  activation; on the last stage also the loss, scaled by 1/m so that gradients
  summed over microbatches are those of the batch's mean loss.
- B(mb, s): the stage's input gradient; the split layers' weight-gradient work
  goes into a W stash (`ppdsl.runtime.split.backward_input`); the graph is freed.
- W(mb, s): runs the stash: weight gradients only.
- BW(mb, s): one backward computing both.
- Exchange: posts its sends (isend) and receives (irecv), and on gloo also the
  receives of the *next* exchange, so their data arrives while this rank computes
  the pass in between (gloo matches by tag, one tag per transfer, so posting early
  is safe); waits only for the receives the next pass needs; sends finish in the
  background and are collected at later exchanges and at the step's end. On NCCL,
  which matches in order, an exchange is one batch_isend_irecv, as lowered and
  checked for deadlock. Two stages on one rank hand over without a transfer.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist

from ppdsl.ir.rank import Compute, Exchange, Op, Transfer, TransferKind
from ppdsl.ir.schedule import MemoryModel, PassKind
from ppdsl.runtime.memory import MemoryMeter
from ppdsl.runtime.split import WStash, backward_input, uncovered_parameters
from ppdsl.runtime.trace import Tracer

__all__ = ["Engine", "PeerError", "StepResult", "probe_shapes"]


class PeerError(RuntimeError):
    """A transfer with another rank failed or timed out."""


@dataclass
class StepResult:
    """What one step measured on this rank."""

    loss: float | None
    """The batch's mean loss (on the rank holding the last stage), else None."""
    step_time: float
    compute_time: float


def _tag(t: Transfer, num_microbatches: int, num_stages: int) -> int:
    kind = 0 if t.kind is TransferKind.ACT else 1
    return (kind * num_microbatches + t.microbatch) * num_stages + t.dst_stage


class Engine:
    """Runs one rank's ops; holds its stages and optimizer."""

    def __init__(
        self,
        rank: int,
        ops: Sequence[Op],
        stage_device: Sequence[int],
        num_microbatches: int,
        memory: MemoryModel,
        model: Any,
        device: torch.device,
        shapes: dict[int, tuple[tuple[int, ...], torch.dtype]] | None = None,
        *,
        lr: float = 3e-3,
        optimizer: str = "adam",
        timeout: float = 60.0,
        release: str = "b",
    ) -> None:
        if release not in ("b", "w"):
            raise ValueError(f"release must be 'b' or 'w', not {release!r}")
        self.rank = rank
        self.release = release
        """When a split backward frees a microbatch-stage's activations: "b" (B frees
        all but the layer inputs its W needs) or "w" (the whole autograd graph is kept
        until W, as torch.distributed.pipelining's split does and as the
        controllable-memory paper counts: M_W = M_B)."""
        self.ops = tuple(ops)
        self.stage_device = tuple(stage_device)
        self.num_stages = len(stage_device)
        self.num_microbatches = num_microbatches
        self.memory = memory
        self.model = model
        self.device = device
        self.shapes = shapes or {}
        """{stage: (shape, dtype)} of each stage's output (see `probe_shapes`)."""
        self.timeout = timedelta(seconds=timeout)
        self.nccl = dist.is_initialized() and dist.get_backend() == "nccl"
        self.stages: dict[int, torch.nn.Module] = {}
        self.split = any(
            isinstance(op, Compute) and op.pass_.kind is PassKind.W for op in self.ops
        )
        for s, dev in enumerate(self.stage_device):
            if dev == rank:
                self.stages[s] = model.stage(s).to(device)
        self.params = [p for m in self.stages.values() for p in m.parameters()]
        # For each exchange, the next one: its receives are posted a pass ahead.
        self._next_exchange: dict[int, Exchange | None] = {}
        upcoming: Exchange | None = None
        for index in range(len(self.ops) - 1, -1, -1):
            op = self.ops[index]
            if isinstance(op, Exchange):
                self._next_exchange[index] = upcoming
                upcoming = op
        opt_class = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}[optimizer]
        self.optimizer = opt_class(self.params, lr=lr) if self.params else None
        self.meter = MemoryMeter(self.params)
        self.compute_time: dict[PassKind, float] = {k: 0.0 for k in PassKind}
        self.tracer: Tracer | None = None
        """When set, every pass, exchange and optimizer step is recorded in it."""

    # -- one step ------------------------------------------------------------

    def step(
        self, step: int, batch_size: int, *, optimizer_step: bool = True, measure: bool = True
    ) -> StepResult:
        """One training step. `measure=False` skips the memory meter (its saved-tensor
        hooks cost Python time on every saved tensor; the activations of a step with
        static shapes are the same every step, so measuring one step is enough)."""
        inputs, targets = self.model.batch(step, batch_size)
        m = self.num_microbatches
        self._inputs = [t.to(self.device) for t in torch.tensor_split(inputs, m)]
        self._targets = [t.to(self.device) for t in torch.tensor_split(targets, m)]
        self._inbox: dict[tuple[TransferKind, int, int], torch.Tensor] = {}
        self._outbox: dict[tuple[TransferKind, int, int], torch.Tensor] = {}
        self._state: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self._stash: dict[tuple[int, int], WStash] = {}
        self._sends: list[tuple[Any, torch.Tensor, Transfer]] = []
        self._losses: list[torch.Tensor] = []  # summed once at the end: no GPU sync per pass
        self._measure = measure
        if measure:
            self.meter.reset_peak()
        for p in self.params:
            p.grad = None
        compute = 0.0
        start = time.perf_counter()
        self._posted: dict[Transfer, tuple[Any, torch.Tensor]] = {}
        tracer = self.tracer
        for index, op in enumerate(self.ops):
            if isinstance(op, Exchange):
                if tracer is None or not (op.sends or op.recvs):
                    self._exchange(op, self._next_exchange[index])
                    continue
                tracer.begin()
                self._exchange(op, self._next_exchange[index])
                tracer.end("exchange", "exchange",
                           {"sends": [str(t) for t in op.sends], "recvs": [str(t) for t in op.recvs]},
                           None)
            else:
                if tracer is not None:
                    tracer.begin()
                t0 = time.perf_counter()
                self._compute(op)
                dt = time.perf_counter() - t0
                compute += dt
                self.compute_time[op.pass_.kind] += dt
                if tracer is not None:
                    done = op.pass_
                    tracer.end(f"{done.kind.value}{done.microbatch}", done.kind.value,
                               {"stage": done.stage, "microbatch": done.microbatch},
                               (done.kind.value, done.stage))
        for work, _, transfer in self._sends:
            self._wait(work, transfer)
        self._sends.clear()
        if optimizer_step and self.optimizer is not None:
            if tracer is not None:
                tracer.begin()
            self.optimizer.step()
            if tracer is not None:
                tracer.end("optimizer", "optimizer", {}, None)
        if tracer is not None:
            tracer.flush()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        holds_loss = self.stage_device[-1] == self.rank
        loss = float(torch.stack(self._losses).sum()) if holds_loss and self._losses else None
        return StepResult(loss, elapsed, compute)

    def _compute(self, op: Compute) -> None:
        p = op.pass_
        key = (p.microbatch, p.stage)
        if p.kind is PassKind.F:
            self._forward(p.microbatch, p.stage)
        elif p.kind is PassKind.W:
            stash = self._stash.pop(key)
            stash.run()
            if self._measure:
                self.meter.set_stash(key, [], [])
        else:
            self._backward(p.microbatch, p.stage, fused=p.kind is PassKind.BW)
        if self._measure:
            self.meter.after(p.kind, key, self.memory.activation[p.stage])

    def _forward(self, mb: int, s: int) -> None:
        if s == 0:
            x = None
            value = self._inputs[mb]
        else:
            value = self._take(TransferKind.ACT, mb, s)
            x = value.requires_grad_(True)
        with self.meter.saving((mb, s)) if self._measure else contextlib.nullcontext():
            out = self.stages[s](value)
            if s == self.num_stages - 1:
                loss = self.model.loss(out, self._targets[mb])
                self._losses.append(loss.detach() / self.num_microbatches)
                out = loss / self.num_microbatches
        self._state[(mb, s)] = (x, out)
        if s < self.num_stages - 1:
            self._give(TransferKind.ACT, mb, s, s + 1, out.detach())

    def _backward(self, mb: int, s: int, fused: bool) -> None:
        x, out = self._state.pop((mb, s))
        grad = None if s == self.num_stages - 1 else self._take(TransferKind.GRAD, mb, s)
        stash = None
        if fused:
            torch.autograd.backward(out, grad)
            grad_x = x.grad if x is not None else None
        else:
            stash = WStash()
            hold = self.release == "w"
            grad_x = backward_input(out, grad, x, stash, retain_graph=hold)
            if hold:
                stash.graph = out  # the graph and its saved activations live until W
        del out, grad
        if stash is not None:
            self._stash[(mb, s)] = stash
            if self._measure:
                self.meter.set_stash((mb, s), stash.tensors, stash.gradients)
        if s > 0:
            assert grad_x is not None
            self._give(TransferKind.GRAD, mb, s, s - 1, grad_x)

    # -- hand-over and transfers ---------------------------------------------

    def _give(self, kind: TransferKind, mb: int, src: int, dst: int, value: torch.Tensor) -> None:
        if self.stage_device[dst] == self.rank:
            self._inbox[(kind, mb, dst)] = value  # the V's turn: no transfer
        else:
            self._outbox[(kind, mb, src)] = value.contiguous()

    def _take(self, kind: TransferKind, mb: int, stage: int) -> torch.Tensor:
        return self._inbox.pop((kind, mb, stage))

    def _post_recv(self, t: Transfer) -> tuple[Any, torch.Tensor]:
        stage = t.src_stage if t.kind is TransferKind.ACT else t.dst_stage
        shape, dtype = self.shapes[stage]
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        tag = _tag(t, self.num_microbatches, self.num_stages)
        try:
            work = dist.irecv(buf, t.src_rank, tag=tag)
        except RuntimeError as exc:
            raise PeerError(f"posting the receive of {t} failed: {exc}") from exc
        return work, buf

    def _exchange(self, op: Exchange, upcoming: Exchange | None) -> None:
        """Post the sends and receives of `op`; on gloo (tags match transfers, so order
        does not matter) also post the receives of the next exchange, so that their
        data arrives while this rank runs the pass in between; wait for `op`'s
        receives."""
        self._sends = [s for s in self._sends if not s[0].is_completed()]
        sends = [(self._outbox.pop((t.kind, t.microbatch, t.src_stage)), t) for t in op.sends]
        if self.nccl:  # NCCL matches in order: one batch per exchange, as the checker proved
            m, n = self.num_microbatches, self.num_stages
            recvs = []
            p2p = []
            for t in op.recvs:
                stage = t.src_stage if t.kind is TransferKind.ACT else t.dst_stage
                shape, dtype = self.shapes[stage]
                buf = torch.empty(shape, dtype=dtype, device=self.device)
                recvs.append((buf, t))
                p2p.append(dist.P2POp(dist.irecv, buf, t.src_rank, tag=_tag(t, m, n)))
            p2p += [dist.P2POp(dist.isend, v, t.dst_rank, tag=_tag(t, m, n)) for v, t in sends]
            for work in dist.batch_isend_irecv(p2p) if p2p else []:
                work.wait()
            for buf, t in recvs:
                self._inbox[(t.kind, t.microbatch, t.dst_stage)] = buf
            return
        for value, t in sends:
            tag = _tag(t, self.num_microbatches, self.num_stages)
            try:
                self._sends.append((dist.isend(value, t.dst_rank, tag=tag), value, t))
            except RuntimeError as exc:
                raise PeerError(f"posting the send of {t} failed: {exc}") from exc
        for t in op.recvs:
            if t not in self._posted:
                self._posted[t] = self._post_recv(t)
        for t in upcoming.recvs if upcoming is not None else ():
            if t not in self._posted:
                self._posted[t] = self._post_recv(t)
        for t in op.recvs:
            work, buf = self._posted.pop(t)
            self._wait(work, t)
            self._inbox[(t.kind, t.microbatch, t.dst_stage)] = buf

    def _wait(self, work: Any, t: Transfer) -> None:
        peer = t.src_rank if t.dst_rank == self.rank else t.dst_rank
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            what = "receiving" if t.dst_rank == self.rank else "sending"
            text = str(exc)
            if "reset by peer" in text or "closed" in text.lower() or "EOF" in text:
                why = f"the connection to rank {peer} was lost (rank {peer} died)"
            elif "timed out" in text.lower() or "timeout" in text.lower():
                why = (f"rank {peer} did not answer within "
                       f"{self.timeout.total_seconds():g} s (hung or deadlocked)")
            else:
                first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
                why = f"rank {peer} failed ({first[:200]})"
            raise PeerError(f"{what} {t}: {why}") from exc

    def uncovered(self, batch_size: int) -> dict[int, list[str]]:
        """Per stage of this rank: the parameters whose gradient B computes because
        the split does not cover them (found from one probe forward each; needs
        `shapes`). Empty for a schedule without W passes."""
        if not self.split:
            return {s: [] for s in self.stages}
        found: dict[int, list[str]] = {}
        for s, module in self.stages.items():
            if s == 0:
                inputs, _ = self.model.batch(0, batch_size)
                x = torch.tensor_split(inputs, self.num_microbatches)[0].to(self.device)
            else:
                shape, dtype = self.shapes[s - 1]
                x = torch.zeros(shape, dtype=dtype, device=self.device)
            found[s] = uncovered_parameters(module, x)
        return found

    # -- results ---------------------------------------------------------------

    def measured_mw_ratio(self) -> dict[int, Fraction]:
        """Per stage of this rank: bytes held after B / bytes held after F."""
        ratios: dict[int, Fraction] = {}
        for (mb, s), after in self.meter.after_b.items():
            f = self.meter.f_bytes.get((mb, s))
            if f:
                ratios.setdefault(s, Fraction(after, f))
        return ratios

    def stage_bytes(self) -> dict[int, int]:
        """Per stage of this rank: the bytes of one microbatch's activations (1 M_B)."""
        found: dict[int, int] = {}
        for (_mb, s), b in self.meter.f_bytes.items():
            found.setdefault(s, b)
        return found


def probe_shapes(
    model: Any,
    stages: dict[int, torch.nn.Module],
    stage_device: Sequence[int],
    rank: int,
    num_microbatches: int,
    batch_size: int,
    device: torch.device,
) -> tuple[dict[int, tuple[tuple[int, ...], torch.dtype]], str | None]:
    """Run microbatch 0 of step 0 through every stage once, stage by stage, on the
    rank holding it (no gradients), broadcasting each output's shape; returns
    {stage: (shape, dtype)} of every stage's output and the first error message
    (the same on every rank) or None. This is where a stage that cannot take the
    previous stage's output, or a loss that cannot take the last, is caught."""
    num_stages = len(stage_device)
    inputs, targets = model.batch(0, batch_size)
    x_in = torch.tensor_split(inputs, num_microbatches)[0].to(device)
    t_in = torch.tensor_split(targets, num_microbatches)[0].to(device)
    shapes: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
    prev: tuple[tuple[int, ...], torch.dtype] | None = None
    for s in range(num_stages):
        owner = stage_device[s]
        payload: list[Any] = [None]
        if owner == rank:
            try:
                with torch.no_grad():
                    module = stages[s]
                    if s == 0:
                        value = x_in
                    else:
                        assert prev is not None
                        value = torch.zeros(prev[0], dtype=prev[1], device=device)
                    out = module(value)
                    if not isinstance(out, torch.Tensor):
                        raise TypeError(f"returned {type(out).__name__}, expected one tensor")
                    if s == num_stages - 1:
                        loss = model.loss(out, t_in)
                        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                            raise TypeError("loss(output, target) must return a scalar tensor")
                payload = [(tuple(out.shape), str(out.dtype).removeprefix("torch."), None)]
            except Exception as exc:  # the user's model: report, don't crash
                what = (
                    f"stage {s} (on rank {owner})"
                    + (f" cannot take stage {s - 1}'s output of shape {list(prev[0])}" if s and prev else "")
                )
                payload = [(None, None, f"{what}: {type(exc).__name__}: {exc}")]
        dist.broadcast_object_list(payload, src=owner)
        shape, dtype_name, error = payload[0]
        if error is not None:
            return shapes, error
        prev = (tuple(shape), getattr(torch, dtype_name))
        shapes[s] = prev
    return shapes, None

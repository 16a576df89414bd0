"""Measuring activation memory: the bytes each microbatch-stage keeps alive for its
backward, counted from the tensors themselves.

During a forward, `saved_tensors_hooks` wraps every tensor autograd saves (other
than parameters) in a small box that the meter only references weakly; once
autograd frees a saved tensor (at the end of B, or of a fused backward) its box
dies. What a microbatch-stage holds at any moment is the storage of its live boxes
plus the layer inputs in its W stash, each storage counted once. Nothing is
assumed about what B or W free: the meter looks. The output gradients a W stash
also holds are gradient buffers, not activations (the compiler's memory model has
no term for them): their peak is reported apart, in bytes.

Under autocast (bf16/fp16) a layer saves the low-precision copy of its weight
that autocast made. The runtime casts once per step (`Engine.step` keeps
autocast's cast cache for the whole step), so every microbatch's graph saves
the same copy: the meter counts such copies apart, once, as the stage's weight
copy (`peak_weight_copy_bytes`), not as any microbatch's activation.

Units: the bytes one microbatch-stage holds right after its F are 1 M_B of that
stage (the compiler's unit); after B, what it still holds divided by that is the
model's real M_W / M_B. On a stage marked `recompute` the F keeps only its input
(registered with `set_kept`): those bytes over the bytes held right after R (its
1 M_B) are the real M_I / M_B. Totals are put in units when read (`peak_units`),
once every microbatch-stage's unit is known.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch

from ppdsl.ir.schedule import MemoryModel, PassKind
from ppdsl.runtime.execution.dtensor import local_tensor
from ppdsl.semantics import memory_delta

__all__ = ["DevicePeak", "MemoryMeter", "predicted_device_peak", "storage_bytes"]


class _Box:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@dataclass
class _Held:
    boxes: list[weakref.ref] = field(default_factory=list)
    stash: list[torch.Tensor] = field(default_factory=list)
    kept: list[torch.Tensor] = field(default_factory=list)
    """What a recomputed stage's F keeps for its R (the stage's input)."""

    def tensors(self) -> list[torch.Tensor]:
        alive = [b() for b in self.boxes]
        return [b.tensor for b in alive if b is not None] + list(self.stash) + list(self.kept)


class MemoryMeter:
    """Per rank: what each (microbatch, stage) holds, and the peak of the total."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self._param_ptrs: set[int] = set()
        self.add_parameters(params)
        self._held: dict[tuple[int, int], _Held] = {}
        self._bytes: dict[tuple[int, int], int] = {}
        self.f_bytes: dict[tuple[int, int], int] = {}
        """Bytes held right after each F (after R on a recomputed stage): that
        microbatch-stage's 1 M_B."""
        self.kept_bytes: dict[tuple[int, int], int] = {}
        """Bytes a recomputed stage's F keeps until its R (the real M_I)."""
        self.after_b: dict[tuple[int, int], int] = {}
        """Bytes still held right after each B (the model's real M_W)."""
        self.peak_bytes = 0
        self._events: list[tuple[tuple[int, int], int | None, Fraction]] = []
        self._gradient_bytes: dict[tuple[int, int], int] = {}
        self.peak_gradient_bytes = 0
        """Peak of the output gradients held in W stashes (not activations)."""
        self._stage_gradients: dict[int, int] = {}
        self._copies: dict[int, weakref.ref] = {}
        self.peak_weight_copy_bytes = 0
        """Peak of the low-precision weight copies autocast made that autograd
        saved (bf16/fp16; each distinct copy once, counted apart from activations)."""

    def add_parameters(self, params: Iterable[torch.Tensor]) -> None:
        """Tensors autograd saves that are these parameters are not activations (a
        sharded stage's gathered parameters live in storage that changes at each
        gather). A DTensor counts by its local shard."""
        for p in params:
            self._param_ptrs.add(local_tensor(p).untyped_storage().data_ptr())

    def saving(self, key: tuple[int, int]) -> torch.autograd.graph.saved_tensors_hooks:
        """Context for the forward of `key`: boxes every saved non-parameter tensor."""
        held = self._held.setdefault(key, _Held())

        def pack(t: torch.Tensor) -> object:
            if t.untyped_storage().data_ptr() in self._param_ptrs:
                return t
            box = _Box(t)
            if self._is_weight_copy(t):
                self._copies.setdefault(t.untyped_storage().data_ptr(), weakref.ref(box))
            else:
                held.boxes.append(weakref.ref(box))
            return box

        def unpack(obj: object) -> torch.Tensor:
            return obj.tensor if isinstance(obj, _Box) else obj  # type: ignore[return-value]

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _is_weight_copy(self, t: torch.Tensor) -> bool:
        """Whether `t` is a parameter cast to another dtype (autocast's copy), or a
        transpose or view of one: autograd's path from it reaches a parameter's
        accumulator through single-input nodes only."""
        node = t.grad_fn
        for _ in range(4):
            if node is None:
                return False
            variable = getattr(node, "variable", None)
            if variable is not None:
                local = local_tensor(variable)
                return bool(local.dtype != t.dtype
                            and local.untyped_storage().data_ptr() in self._param_ptrs)
            nexts = node.next_functions
            if len(nexts) != 1:
                return False
            node = nexts[0][0]
        return False

    def weight_copy_bytes(self) -> int:
        """Bytes of the weight copies saved by graphs still alive (each once)."""
        alive = [b() for b in self._copies.values()]
        self._copies = {k: r for k, r, b in zip(self._copies, self._copies.values(), alive, strict=True)
                        if b is not None}
        return storage_bytes(b.tensor for b in alive if b is not None)

    def set_stash(
        self,
        key: tuple[int, int],
        tensors: list[torch.Tensor],
        gradients: list[torch.Tensor] | None = None,
    ) -> None:
        """`key`'s W stash: the layer inputs it holds (activations) and the output
        gradients (counted apart)."""
        self._held.setdefault(key, _Held()).stash = tensors
        self._gradient_bytes[key] = storage_bytes(gradients or [])
        s = key[1]
        self._stage_gradients[s] = max(self._stage_gradients.get(s, 0), self._gradient_bytes[key])
        self.peak_gradient_bytes = max(self.peak_gradient_bytes, sum(self._gradient_bytes.values()))

    def stash_gradient_bytes(self) -> dict[int, int]:
        """Per stage: the most one microbatch's W stash held in output gradients."""
        return dict(self._stage_gradients)

    def set_kept(self, key: tuple[int, int], tensors: list[torch.Tensor]) -> None:
        """What `key`'s F keeps for its R (a recomputed stage's input); [] once R
        has run (the recomputed graph then holds what it needs)."""
        self._held.setdefault(key, _Held()).kept = tensors

    def after(
        self, kind: PassKind, key: tuple[int, int], activation: Fraction, recomputed: bool = False
    ) -> None:
        """Re-measure `key` after a pass of `kind` on it; `activation` is the
        file's M_B of the stage, to express the total in its units; `recomputed`:
        the stage is marked `recompute` (its 1 M_B is measured after R)."""
        # Only `key`'s own passes free its tensors, so only its count can have changed.
        held = self._held.get(key)
        self._bytes[key] = storage_bytes(held.tensors()) if held is not None else 0
        if kind is PassKind.F and recomputed:
            self.kept_bytes[key] = self._bytes[key]
        elif kind in (PassKind.F, PassKind.R):
            self.f_bytes[key] = self._bytes[key]
        elif kind is PassKind.B:
            self.after_b[key] = self._bytes[key]
        if kind in (PassKind.W, PassKind.BW):
            self._held.pop(key, None)
        total = sum(self._bytes.values())
        self.peak_bytes = max(self.peak_bytes, total)
        if self._copies:
            self.peak_weight_copy_bytes = max(self.peak_weight_copy_bytes, self.weight_copy_bytes())
        self._events.append((key, self._bytes[key], Fraction(activation)))
        if kind in (PassKind.W, PassKind.BW):
            self._bytes.pop(key, None)
            self._events.append((key, None, Fraction(activation)))

    @property
    def peak_units(self) -> Fraction:
        """The peak of the total held, each microbatch-stage's bytes in its
        stage's M_B (bytes over its 1 M_B, times the file's M_B), replayed over
        the measured passes."""
        levels: dict[tuple[int, int], tuple[int, Fraction]] = {}
        peak = Fraction(0)
        for key, held, activation in self._events:
            if held is None:
                levels.pop(key, None)
                continue
            levels[key] = (held, activation)
            units = sum(
                (Fraction(b, self.f_bytes[k]) * a for k, (b, a) in levels.items() if self.f_bytes.get(k)),
                Fraction(0),
            )
            peak = max(peak, units)
        return peak

    def reset_peak(self) -> None:
        self.peak_bytes = 0
        self.peak_weight_copy_bytes = 0
        self._events = []
        self.peak_gradient_bytes = 0


class DevicePeak:
    """The device allocator's peak over a window, from the window's own baseline:
    `start` reads what is allocated and resets the peak, `stop` takes the peak
    since minus that baseline (the largest over all windows is `bytes`). The
    training loop opens the window after `zero_grad` and closes it when the
    step's passes end, before the optimizer: every step is measured from the
    same state (parameters and optimizer state, no gradients); it leaves out the
    first step when there are several (what it allocates once for the run).
    `allocated`, `peak` and `reset` default to torch.cuda's counters for
    `device` (tests give others).

    Inside a window (or outside one), `pass_window(kind, stage)` measures one
    pass's working memory: what it allocates and frees within itself (a
    layer's intermediates, the gradients flowing back through it), which the
    compiler's model of what passes keep does not hold. The engine opens one
    around each pass of a measured step; the step's peak is kept across them."""

    def __init__(self, device: torch.device, *, allocated: Any = None, peak: Any = None,
                 reset: Any = None) -> None:
        self.device = device
        self._allocated = allocated or (lambda: torch.cuda.memory_allocated(device))
        self._peak = peak or (lambda: torch.cuda.max_memory_allocated(device))
        self._reset = reset or (lambda: torch.cuda.reset_peak_memory_stats(device))
        self._base: int | None = None
        self._high = 0
        """The window's peak as read before a pass window reset the counter."""
        self.bytes: int | None = None
        """The largest window peak so far, in bytes above its baseline (None before
        a window closed)."""
        self.working: dict[tuple[PassKind, int], int] = {}
        """Per (pass kind, stage): the most one pass rose above the larger of
        what was allocated before it and after it."""

    def start(self) -> None:
        """Open a window: the baseline is what is allocated now."""
        self._base = self._allocated()
        self._reset()
        self._high = 0

    def stop(self) -> None:
        """Close the window opened by `start`."""
        assert self._base is not None, "DevicePeak.stop without start"
        found = max(self._high, self._peak()) - self._base
        self.bytes = found if self.bytes is None else max(self.bytes, found)
        self._base = None

    def working_by_pass(self) -> dict[str, int]:
        """`working` keyed as the summary prints passes ("B3"), by stage then kind."""
        order = sorted(self.working.items(), key=lambda kv: (kv[0][1], kv[0][0].value))
        return {f"{kind.value}{stage}": b for (kind, stage), b in order}

    @contextlib.contextmanager
    def pass_window(self, kind: PassKind, stage: int) -> Iterator[None]:
        """Around one pass of `kind` on `stage`: its working memory into `working`."""
        self._high = max(self._high, self._peak())
        before = self._allocated()
        self._reset()
        yield
        peak, after = self._peak(), self._allocated()
        self._high = max(self._high, peak)
        key = (kind, stage)
        self.working[key] = max(self.working.get(key, 0), peak - max(before, after))


def predicted_device_peak(
    passes: Iterable[tuple[PassKind, int, int]],
    memory: MemoryModel,
    stage_bytes: Mapping[int, int],
    *,
    working: Mapping[tuple[PassKind, int], int] | None = None,
    stash_gradients: Mapping[int, int] | None = None,
    first_gradients: Mapping[int, int] | None = None,
) -> int:
    """The allocator peak one device's order predicts, in bytes above the step's
    baseline. Between passes the device holds what the memory model says its
    passes keep (`memory`'s deltas in M_B, a stage's M_B being `stage_bytes[s]`),
    plus a W stash's output gradients (`stash_gradients[s]` bytes per
    microbatch, from its B to its W) and the parameters' gradients once a
    stage's first backward made them (`first_gradients[s]`: 0 where they are in
    the baseline); during a pass, its working memory (`working[(kind, s)]`,
    as `DevicePeak.pass_window` measures it) on top of the larger of the levels
    before and after it. `passes`: (kind, microbatch, stage) in order."""
    working = working or {}
    stash_gradients = stash_gradients or {}
    first = dict(first_gradients or {})
    level = Fraction(0)
    peak = Fraction(0)
    for kind, _mb, stage in passes:
        kept = memory.kept_input[stage] if memory.kept_input else None
        units = memory_delta(kind, memory.activation[stage], memory.weight_retained[stage], kept)
        delta = units / memory.activation[stage] * stage_bytes.get(stage, 0)
        if kind is PassKind.B:
            delta += stash_gradients.get(stage, 0)
        elif kind is PassKind.W:
            delta -= stash_gradients.get(stage, 0)
        if kind in (PassKind.W, PassKind.BW):
            delta += first.pop(stage, 0)
        before, level = level, level + delta
        peak = max(peak, max(before, level) + working.get((kind, stage), 0))
    return round(peak)

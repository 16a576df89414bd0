"""A transformers causal LM's real size from its `config.json` alone: no
weights read, no FLOP spent (`ppdsl plan --gpu`).

- The model is built on the meta device (shapes, no storage); each layer's
  parameter count comes from its shapes.
- One decoder layer, the embedding and the head (final norm, LM head and the
  loss) each run once, as `HFStage` runs them, at the run's sequence length and
  microbatch size under `FakeTensorMode`: tensors carry shapes and dtypes only.
  `saved_tensors_hooks` see what autograd keeps for the backward; their
  storages, each counted once and parameters left out, are the layer's M_B (the
  runtime's meter counts the same way). The part of them that is some linear
  layer's input is M_W (what the weight gradient dW = dyᵀ·x reads, §2 of the
  zero-bubble paper); the linear layers' outputs are the output gradients a W
  stash keeps.
- Working memory per pass kind: a dispatch mode counts every storage an op
  makes until it dies (`tests/oracles/allocator.py`'s rule); a pass's working
  memory is its peak above the larger of the levels before and after it. The
  split B and W are given the fused backward's (an upper bound for each).
- FLOPs per pass kind from `FlopCounterMode`: F the forward; W the linear
  layers' weight-gradient matmuls (2·tokens·in·out each); B the fused
  backward's rest. Times are FLOPs over a `DeviceSpec`'s peak at its stated
  efficiency; memory-bound work (norms, element-wise ops) is not timed.

Every decoder layer of the models ppdsl cuts has the same shapes, so one is run
and its figures stand for each.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from ppdsl.runtime.errors import ModelError
from ppdsl.runtime.measure.cut import LayerProfile
from ppdsl.runtime.measure.records import StageTiming
from ppdsl.runtime.models.hf import HFStage, anatomy_of, read_config, transformers_module

__all__ = ["DEVICES", "DeviceSpec", "LayerSize", "ModelSize", "device_spec", "fake_layer_bytes",
           "model_size"]


@dataclass(frozen=True)
class DeviceSpec:
    """What a pass's time at real size is computed from."""

    name: str
    bf16_tflops: float
    """Peak dense bf16 tensor-core TFLOPS (fp32 runs at the same peak through TF32
    is not assumed: fp32 work is timed at `fp32_tflops`)."""
    fp32_tflops: float
    """Peak dense TF32 TFLOPS (what fp32 matmuls use with TF32 allowed)."""
    hbm_gbps: float
    """HBM bandwidth, GB/s."""
    link_gbps: float
    """One direction of the GPU-to-GPU link (NVLink), GB/s: a stage boundary's
    transfer time is its bytes over this."""
    efficiency: float
    """The stated fraction of peak a transformer layer's matmuls reach."""
    memory_bytes: int
    """The device's memory (the default budget)."""


DEVICES = {
    # NVIDIA's data sheets (SXM parts, dense, no sparsity); efficiency 0.5 is a stated guess
    "h100": DeviceSpec("h100", 989.0, 494.0, 3350.0, 450.0, 0.5, 80 * 2**30),
    "h200": DeviceSpec("h200", 989.0, 494.0, 4800.0, 450.0, 0.5, 141 * 10**9),
    "a100": DeviceSpec("a100", 312.0, 156.0, 2039.0, 300.0, 0.5, 80 * 2**30),
}
"""The named devices of `--gpu`."""


def device_spec(text: str) -> DeviceSpec:
    """`h100`, `h200`, `a100`, or a JSON file with `DeviceSpec`'s fields;
    ValueError with what to give otherwise."""
    if text.lower() in DEVICES:
        return DEVICES[text.lower()]
    path = Path(text)
    if not path.is_file():
        raise ValueError(f"--gpu {text!r}: give h100, h200, a100 or a JSON file with the fields "
                         "name, bf16_tflops, fp32_tflops, hbm_gbps, link_gbps, efficiency, "
                         "memory_bytes")
    try:
        fields = json.loads(path.read_text())
        spec = DeviceSpec(**fields)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"--gpu {text!r}: not a device spec: {exc}") from None
    if min(spec.bf16_tflops, spec.fp32_tflops, spec.link_gbps, spec.efficiency) <= 0:
        raise ValueError(f"--gpu {text!r}: TFLOPS, link bandwidth and efficiency must be positive")
    return spec


@dataclass(frozen=True)
class LayerSize:
    """One layer (embedding, decoder layer or head) at the run's shapes."""

    parameters: int
    """Parameter count."""
    activation_bytes: int
    """M_B: what autograd keeps after its F (parameters left out, storages once)."""
    weight_bytes: int
    """M_W: the part of it the linear layers' weight gradients read."""
    stash_bytes: int
    """Output gradients of its linear layers (what a W stash keeps)."""
    output_bytes: int
    """The tensor it passes on."""
    working: dict[str, int]
    """Per pass kind (F, B, W, BW, R), bytes allocated and freed within the pass."""
    flops: dict[str, int]
    """Per pass kind (F, B, W, BW)."""


@dataclass(frozen=True)
class ModelSize:
    """A causal LM's layers at the run's shapes."""

    names: tuple[str, ...]
    """`embedding`, `layer 0` ... `layer n-1`, `head` (as `LayerProfile.names`)."""
    layers: tuple[LayerSize, ...]
    microbatch_size: int
    seq_len: int
    dtype: str
    """The compute dtype the layers ran in (bf16 or fp32)."""

    @property
    def num_layers(self) -> int:
        """Decoder layers."""
        return len(self.names) - 2

    def profile(self, spec: DeviceSpec) -> LayerProfile:
        """The layers as the per-layer profile `ppdsl plan` cuts, times from
        FLOPs over `spec`."""
        tflops = spec.bf16_tflops if self.dtype == "bf16" else spec.fp32_tflops

        def ms(flops: int) -> float:
            return flops / (tflops * 1e12 * spec.efficiency) * 1e3

        timings = tuple(
            StageTiming(forward_ms=ms(x.flops["F"]), input_ms=ms(x.flops["B"]),
                        weight_ms=ms(x.flops["W"]), plain_forward_ms=ms(x.flops["F"]),
                        fused_ms=ms(x.flops["BW"]), activation_bytes=x.activation_bytes,
                        plain_activation_bytes=x.activation_bytes, weight_bytes=x.weight_bytes,
                        gradient_bytes=x.stash_bytes)
            for x in self.layers)
        return LayerProfile(self.names, timings, self.layers[1].output_bytes,
                            self.microbatch_size, clock="flops")

    def transfer_ms(self, spec: DeviceSpec) -> float:
        """One microbatch's hidden state over the link."""
        return self.layers[1].output_bytes / (spec.link_gbps * 1e9) * 1e3


class _Allocations(TorchDispatchMode):
    """Every storage an op makes (not one of its inputs'), counted until it dies."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.peak = 0
        self._live: dict[int, int] = {}

    def _free(self, key: int, size: int) -> None:
        if self._live.pop(key, None) is not None:
            self.now -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        given = {_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key, size = _key(t), storage.nbytes()
                if size and key not in self._live and key not in given:
                    self._live[key] = size
                    self.now += size
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._free, key, size)
        return out


def _key(t: torch.Tensor) -> int:
    """A storage's identity, for real and fake tensors alike."""
    return int(t.untyped_storage()._cdata)


def _materialise(module: nn.Module, dtype: torch.dtype) -> None:
    """Replace `module`'s meta parameters and buffers by empty ones (fake under
    an open FakeTensorMode); floating ones in `dtype`."""
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                kind = dtype if p.is_floating_point() else p.dtype
                m._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=kind),
                                                   requires_grad=p.requires_grad)
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = torch.empty(b.shape, dtype=b.dtype)


@contextmanager
def _saved(params: set[int]) -> Iterator[dict[int, int]]:
    """The storages autograd saves inside, parameters left out: {key: bytes}."""
    found: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if _key(t) not in params:
            found[_key(t)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield found


def _weight_flops(linears: list[nn.Linear], tokens: int) -> int:
    return sum(2 * tokens * m.in_features * m.out_features for m in linears)


def fake_layer_bytes(stage: nn.Module, x: torch.Tensor, targets: torch.Tensor | None = None,
                     loss: Any = None) -> LayerSize:
    """Run `stage` on `x` (and its loss on `targets`) once, forward and fused
    backward, counting what it keeps, allocates and computes. Under an open
    FakeTensorMode no FLOP is spent; on real tensors it measures the same way
    (the test's reference)."""
    params = {_key(p) for p in stage.parameters()}
    linears: list[nn.Linear] = [m for m in stage.modules() if isinstance(m, nn.Linear)]
    inputs: dict[int, int] = {}
    outputs: list[int] = []  # each linear call's output: one output gradient in the stash

    def seen(_module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        inputs[_key(args[0])] = args[0].untyped_storage().nbytes()
        outputs.append(out.numel() * out.element_size())

    hooks = [m.register_forward_hook(seen) for m in linears]
    counter = _Allocations()
    try:
        with FlopCounterMode(display=False) as forward_flops, counter, _saved(params) as saved:
            out = stage(x)
            result = loss(out, targets) if loss is not None else out
        after_forward = counter.now
        forward_working = counter.peak - after_forward
    finally:
        for h in hooks:
            h.remove()
    output_bytes = out.untyped_storage().nbytes()
    tokens = x.shape[0] * x.shape[1]
    counter.peak = counter.now
    with FlopCounterMode(display=False) as backward_flops, counter:
        before = counter.now
        if loss is None:
            result.backward(torch.ones_like(result))
        else:
            result.backward()
        backward_working = max(0, counter.peak - max(before, counter.now))
    f = forward_flops.get_total_flops()
    bw = backward_flops.get_total_flops()
    w = min(_weight_flops(linears, tokens), bw)
    activation = sum(saved.values())
    weight = sum(b for k, b in saved.items() if k in inputs)
    return LayerSize(
        parameters=sum(p.numel() for p in stage.parameters()),
        activation_bytes=activation, weight_bytes=weight, stash_bytes=sum(outputs),
        output_bytes=output_bytes,
        working={"F": forward_working, "R": forward_working, "B": backward_working,
                 "W": backward_working, "BW": backward_working},
        flops={"F": f, "B": bw - w, "W": w, "BW": bw})


def _masks_as_run(stage: HFStage, mode: FakeTensorMode) -> None:
    """Make `stage` build its attention masks from small real tensors of the
    same batch and sequence, outside the fake mode: transformers treats a fake tensor as tracing and then always
    builds an explicit mask, where a real run at these shapes passes none and
    lets SDPA's `is_causal` (and its grouped-query path) keep less."""
    build = stage._masks

    def masks(hidden: torch.Tensor, positions: torch.Tensor) -> list[Any]:
        with unset_fake_temporarily():
            made = build(torch.zeros(*hidden.shape[:-1], 1, dtype=hidden.dtype),
                         torch.arange(positions.shape[-1]).unsqueeze(0))
        return [mode.from_tensor(m) if isinstance(m, torch.Tensor) else m for m in made]

    stage._masks = masks  # type: ignore[method-assign]


def _build_meta(directory: str) -> Any:
    read_config(directory)
    transformers = transformers_module()
    transformers.utils.logging.set_verbosity_error()
    where = f"--model hf:{directory}"
    try:
        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    except Exception as exc:
        raise ModelError(f"{where}: transformers cannot read its config.json: {exc}") from exc
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as exc:
        raise ModelError(f"{where}: building the model on the meta device failed: "
                         f"{type(exc).__name__}: {exc}") from exc
    model.train()
    return model


def model_size(directory: str, seq_len: int, microbatch_size: int,
               dtype: str = "fp32") -> ModelSize:
    """The layers of the model in `directory` (config.json alone) at these
    shapes, in `dtype` (fp32 or bf16), measured under fake tensors."""
    from ppdsl.runtime.models.hf import _loss

    model = _build_meta(directory)
    anatomy = anatomy_of(model, f"--model hf:{directory}")
    num_layers = len(model.get_submodule(anatomy.layers))
    kind = torch.bfloat16 if dtype == "bf16" else torch.float32
    hidden = int(model.config.hidden_size)
    parts = {
        "embedding": HFStage(model, anatomy, range(0), first=True, last=False),
        "layer": HFStage(model, anatomy, range(1), first=False, last=False),
        "head": HFStage(model, anatomy, range(0), first=False, last=True),
    }
    # each part gets its own parameters: a tied head's weight is the last stage's copy
    sizes: dict[str, LayerSize] = {}
    with FakeTensorMode() as mode:
        for name, stage in parts.items():
            _materialise(stage, kind)
            _masks_as_run(stage, mode)
            ids = torch.zeros(microbatch_size, seq_len, dtype=torch.long)
            states = torch.empty(microbatch_size, seq_len, hidden, dtype=kind, requires_grad=True)
            if name == "embedding":
                sizes[name] = fake_layer_bytes(stage, ids)
            elif name == "layer":
                sizes[name] = fake_layer_bytes(stage, states)
            else:
                sizes[name] = fake_layer_bytes(stage, states, ids, _loss)
    layers = (sizes["embedding"],) + (sizes["layer"],) * num_layers + (sizes["head"],)
    names = ("embedding",) + tuple(f"layer {i}" for i in range(num_layers)) + ("head",)
    return ModelSize(names, layers, microbatch_size, seq_len, dtype)

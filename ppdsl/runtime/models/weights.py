"""A model's tensors, a part at a time: a meta-device model's modules made real
(`materialise`), their values read lazily from the weight files of a
`save_pretrained` folder (`WeightFiles`), and written back as one safetensors
shard per process (`write_shard`, `write_index`).

The initialisation rule without weights. Each module is initialised by its
model's own `_init_weights`, children before parents (transformers'
`initialize_weights` order), with torch's global generator seeded from
`module_seed(seed, name)`, the module's name in the whole model. A module's
values then depend on the seed and its name only, so a process that
materialises some stages holds exactly the tensors the whole model built the
same way holds (`tests/runtime/models/test_weights.py`). A tensor that several
names share (a head tied to the token embedding) takes the rule of its first
name, on every process that holds it under any of them. This is not
`AutoModelForCausalLM.from_config`'s stream (one generator through the whole
model, which only a whole-model build can replay).

Values read from the files are marked `_is_hf_initialized`, the flag
transformers' init functions respect, so `_init_weights` leaves them alone.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ppdsl.runtime.errors import ModelError, first_line

__all__ = ["WeightFiles", "materialise", "module_seed", "tensor_names", "write_shard",
           "write_index", "shard_name", "INDEX"]

INDEX = "model.safetensors.index.json"
"""The index of a sharded safetensors checkpoint: {"metadata", "weight_map": {name: file}}."""
_SINGLE = "model.safetensors"
_BIN, _BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
_FLAG = "_is_hf_initialized"


def module_seed(seed: int, name: str) -> int:
    """The seed of module `name`'s initialisation under run seed `seed`: 63 bits of
    sha256("seed/name"), the same in every process and Python."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class WeightFiles:
    """The weights of a `save_pretrained` folder, read a tensor at a time:
    `model.safetensors`, or the shards `model.safetensors.index.json` lists
    (safetensors' lazy `safe_open`: only the tensors asked for are read), or a
    `pytorch_model.bin` (memory-mapped). Use `WeightFiles.open(DIR)`, which gives
    None when DIR has no weights, and closes the files after."""

    def __init__(self, folder: Path, files: dict[str, str], stack: ExitStack) -> None:
        self.folder = folder
        self.files = files
        """{tensor name: file name in the folder}."""
        self._stack = stack
        self._open: dict[str, Any] = {}

    @classmethod
    @contextmanager
    def open(cls, directory: str | Path) -> Iterator[WeightFiles | None]:
        """The folder's weight files, or None when it holds none."""
        folder = Path(directory)
        files = _weight_map(folder)
        if files is None:
            yield None
            return
        with ExitStack() as stack:
            yield cls(folder, files, stack)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        """Tensor `name`, read from its file now (a fresh CPU tensor)."""
        file = self.files[name]
        handle = self._open.get(file)
        if handle is None:
            handle = self._open[file] = self._handle(file)
        try:
            return handle.get_tensor(name) if hasattr(handle, "get_tensor") else handle[name]
        except Exception as exc:
            raise ModelError(f"{self.folder / file}: cannot read tensor {name!r}: "
                             f"{first_line(exc)}") from exc

    def _handle(self, file: str) -> Any:
        path = self.folder / file
        try:
            if file.endswith(".safetensors"):
                from safetensors import safe_open

                return self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as exc:
            raise ModelError(f"{path}: cannot open the weight file: {first_line(exc)}") from exc


def _weight_map(folder: Path) -> dict[str, str] | None:
    """{tensor name: file} of the folder's weights (safetensors before .bin, an
    index before a single file), or None when it has none."""
    for index in (INDEX, _BIN_INDEX):
        path = folder / index
        if path.is_file():
            try:
                weight_map = json.loads(path.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ModelError(f"{path}: not a weight index (a JSON object with a "
                                 f"weight_map): {exc}") from exc
            if not isinstance(weight_map, dict):
                raise ModelError(f"{path}: its weight_map is no JSON object")
            return {str(k): str(v) for k, v in weight_map.items()}
    for single in (_SINGLE, _BIN):
        path = folder / single
        if path.is_file():
            return {name: single for name in _names_in(path)}
    return None


def _names_in(path: Path) -> list[str]:
    """The tensor names one weight file holds (a .bin is memory-mapped to list them)."""
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt", device="cpu") as f:
                return list(f.keys())
        return list(torch.load(path, map_location="cpu", mmap=True, weights_only=True))
    except Exception as exc:
        raise ModelError(f"{path}: cannot read the weight file: {first_line(exc)}") from exc


def tensor_names(model: nn.Module) -> dict[int, list[str]]:
    """{id of a parameter or buffer: every name it has in `model`}, first name first
    (a tied tensor has several)."""
    names: dict[int, list[str]] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(t), []).append(name)
    for name, b in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(b), []).append(name)
    return names


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def materialise(model: nn.Module, units: Sequence[str], seed: int,
                weights: WeightFiles | None, *, names: dict[int, list[str]] | None = None,
                made: dict[int, torch.Tensor] | None = None) -> None:
    """Make the modules `units` (dotted paths in `model`, each with everything
    under it) real CPU tensors in place: each parameter and buffer still on the
    meta device read from `weights` under any of its names, else initialised by
    the module rule (module docstring). `""` stands for every module left on the
    meta device outside the other units, each on its own. `names` (from
    `tensor_names` on the meta model) and `made` ({id of a meta tensor: the real
    one}) carry over between calls, so a tied tensor met again is the same
    Parameter."""
    names = names if names is not None else tensor_names(model)
    made = made if made is not None else {}
    init_weights = getattr(model, "_init_weights", None)
    for unit in units:
        if unit == "":
            inside = [u for u in units if u]
            walk = [(n, m) for n, m in _post_order(model, "")
                    if not any(n == u or n.startswith(f"{u}.") for u in inside)
                    and _holds_meta(m)]
        else:
            walk = _post_order(model.get_submodule(unit), unit)
        fresh: list[tuple[str, nn.Module]] = []
        aliases: list[tuple[nn.Module, str, str]] = []
        to_init: set[int] = set()
        for name, module in walk:
            if _make_real(module, name, weights, names, made, aliases, to_init) or unit != "":
                fresh.append((name, module))
        if init_weights is None:
            continue
        # everything but the tensors made empty here is left as it is
        held = [t for _, m in fresh for t in _own_tensors(m) if id(t) not in to_init]
        for t in held:
            setattr(t, _FLAG, True)
        try:
            for name, module in fresh:
                _init_module(init_weights, module, seed, name)
            for module, leaf, first in aliases:
                _init_alias(model, init_weights, getattr(module, leaf), first, seed)
        finally:
            for t in held:
                if hasattr(t, _FLAG):
                    delattr(t, _FLAG)


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [t for t in list(module._parameters.values()) + list(module._buffers.values())
            if t is not None]


def _post_order(root: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    """(name, module) of `root` and everything under it, children first."""
    found: list[tuple[str, nn.Module]] = []
    for child_name, child in root.named_children():
        found += _post_order(child, _join(prefix, child_name))
    found.append((prefix, root))
    return found


def _holds_meta(module: nn.Module) -> bool:
    return any(t is not None and t.is_meta for t in
               list(module._parameters.values()) + list(module._buffers.values()))


def _make_real(module: nn.Module, prefix: str, weights: WeightFiles | None,
               names: dict[int, list[str]], made: dict[int, torch.Tensor],
               aliases: list[tuple[nn.Module, str, str]], to_init: set[int]) -> bool:
    """`module`'s own meta tensors made real: read from `weights`, or empty and
    put in `to_init` (its `_init_weights` takes them), or, a tied tensor first
    named elsewhere, queued in `aliases`. Whether `_init_weights` must run."""
    needs_init = bool(getattr(module, "_non_persistent_buffers_set", ()))
    for table, is_parameter in ((module._parameters, True), (module._buffers, False)):
        for leaf, meta in list(table.items()):
            if meta is None or not meta.is_meta:
                continue
            known = made.get(id(meta))
            if known is not None:
                table[leaf] = known  # type: ignore[assignment]
                continue
            own = _join(prefix, leaf)
            every = names.get(id(meta), [own])
            stored = next((n for n in [own] + every if weights is not None and n in weights), None)
            if stored is not None:
                assert weights is not None
                value = weights.get(stored).to(meta.dtype)
                if tuple(value.shape) != tuple(meta.shape):
                    raise ModelError(f"{weights.folder}: tensor {stored!r} has shape "
                                     f"{tuple(value.shape)}, the model's {own} {tuple(meta.shape)}")
            else:
                value = torch.empty_like(meta, device="cpu")
            real: torch.Tensor = (nn.Parameter(value, requires_grad=meta.requires_grad)
                                  if is_parameter else value)
            if stored is None and every[0] != own:
                aliases.append((module, leaf, every[0]))
            elif stored is None:
                to_init.add(id(real))
                needs_init = True
            table[leaf] = real  # type: ignore[assignment]
            made[id(meta)] = real
    return needs_init


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """The global generator seeded with `seed`, and the caller's state restored after."""
    from transformers import initialization

    with torch.random.fork_rng(devices=[]), torch.no_grad(), \
            initialization.guard_torch_init_functions():
        torch.manual_seed(seed)
        yield


def _init_module(init_weights: Any, module: nn.Module, seed: int, name: str) -> None:
    with _seeded(module_seed(seed, name)):
        init_weights(module)


def _init_alias(model: nn.Module, init_weights: Any, tensor: torch.Tensor, first: str,
                seed: int) -> None:
    """`tensor` initialised as the module of its first name `first` would initialise
    it: that module (still on the meta device here, or real) briefly holds it."""
    owner_name, _, leaf = first.rpartition(".")
    owner = model.get_submodule(owner_name)
    table = owner._parameters if leaf in owner._parameters else owner._buffers
    held = table[leaf]
    others = [t for t in list(owner.parameters(recurse=False)) + list(owner.buffers(recurse=False))
              if t is not held and not t.is_meta]
    if hasattr(tensor, _FLAG):
        delattr(tensor, _FLAG)
    flagged = [t for t in others if not hasattr(t, _FLAG)]
    for t in flagged:  # only `tensor` takes the rule here
        setattr(t, _FLAG, True)
    table[leaf] = tensor  # type: ignore[assignment]
    try:
        _init_module(init_weights, owner, seed, owner_name)
    finally:
        table[leaf] = held  # type: ignore[assignment]
        setattr(tensor, _FLAG, True)
        for t in flagged:
            delattr(t, _FLAG)


def shard_name(index: int, count: int) -> str:
    """transformers' name of shard `index` (0-based) of `count`."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
           torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def write_shard(path: str | Path, tensors: Sequence[tuple[str, torch.Tensor]],
                value: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> int:
    """Write `tensors` (name, CPU or device tensor) as one safetensors file,
    streamed: each tensor's bytes go to the file from its own storage (a device
    tensor is copied to the host one at a time), so writing holds no second copy
    of the whole set; `value(t)` is the tensor whose bytes are written (its
    shape and dtype are `t`'s: a DTensor's whole value, say). Returns the bytes
    of tensor data written."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for name, t in tensors:
        if t.dtype not in _DTYPES:
            raise ModelError(f"--save-model: tensor {name!r} has dtype {t.dtype}, which "
                             "safetensors cannot hold")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [at, at + size]}
        at += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for _, t in tensors:
            host = value(t.detach()).to("cpu").contiguous()
            if host.numel():
                f.write(host.reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())
    return at


def write_index(folder: str | Path, weight_map: dict[str, str], total_size: int) -> None:
    """`model.safetensors.index.json`: which shard holds each tensor."""
    document = {"metadata": {"total_size": total_size},
                "weight_map": dict(sorted(weight_map.items()))}
    (Path(folder) / INDEX).write_text(json.dumps(document, indent=2) + "\n")

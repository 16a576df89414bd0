"""Hugging Face causal language models cut into pipeline stages (`--model hf:DIR`).

`DIR` is a local folder in transformers' `save_pretrained` layout: `config.json`
and, optionally, the weights (safetensors); without weights the model is
initialised from the seed: each module by the model's own `_init_weights`,
its generator seeded from (seed, module name) (`ppdsl.runtime.models.weights`),
so a rank that makes only its own stages real holds what the whole model would.
Nothing is downloaded. The model is built on the meta device; each rank makes
real, reads (lazily, from safetensors shards) and saves only its own stages.
What config.json alone says (options, the cut, `preflight`) is in
`ppdsl.runtime.models.hf_config`.

Which models: any causal LM whose config has `base_model_pp_plan` (Llama,
Mistral, Qwen2, Qwen3, Gemma, ...: the plan names, in model order, the
embedding, the decoder layer list and the final norm) and GPT-2. The cut: the
embeddings on the first stage, the decoder layers contiguous (`cut[s]` is the
first layer of stage s), the final norm and the LM head on the last stage. Every
stage with decoder layers computes its own position ids, rotary embeddings (the
model's own `rotary_emb`) and causal mask (transformers' own `create_causal_mask`,
or the sliding-window one for the layers whose type says so), so only the hidden
states move between stages. A head tied to the token embedding is declared
`tied` (its gradient summed across its owners). The loss is the causal-LM
cross-entropy of the logits against targets already shifted by the data
(`ppdsl.runtime.models.data`).

`check_cut` runs the cut model and the whole model on the same tokens and
compares the logits: a family whose base model does more than the plan says (a
scaled embedding, say) is refused before training instead of trained wrongly.

`transformers` is an optional dependency (`pip install ppdsl[hf]`); it is
imported only when a `hf:` model is used.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ppdsl.runtime.errors import first_line
from ppdsl.runtime.models.data import DataError, batch_tokens, open_tokens
from ppdsl.runtime.models.documents import IGNORED, is_documents, open_batches
from ppdsl.runtime.models.hf_config import (
    PREFIX,
    HFOptions,
    auto_config,
    equal_cut,
    is_hf_spec,
    layer_count,
    parse_cut,
    preflight,
    quiet_logging,
    read_config,
    transformers_module,
    vocab_size_of,
    where_of,
)
from ppdsl.runtime.models.model import ModelError, PipelineModel
from ppdsl.runtime.models.weights import (
    INDEX,
    WeightFiles,
    materialise,
    shard_name,
    tensor_names,
    write_index,
    write_shard,
)

__all__ = [
    "HFOptions",
    "Anatomy",
    "HFStage",
    "HFPipelineModel",
    "PREFIX",
    "is_hf_spec",
    "read_config",
    "load_causal_lm",
    "anatomy_of",
    "equal_cut",
    "parse_cut",
    "preflight",
    "pipeline_model",
    "check_cut",
    "check_family",
    "meta_model",
    "import_library",
    "save_by_stage",
]


@dataclass(frozen=True)
class Anatomy:
    """Where a causal LM's parts are, as dotted module paths in the whole model."""

    embeddings: tuple[str, ...]
    """Modules of the first stage, before the layers (GPT-2: wte, wpe, drop)."""
    layers: str
    """The decoder layers' ModuleList."""
    finals: tuple[str, ...]
    """Modules after the layers, in order (the final norm, then the LM head)."""
    rotary: str | None
    """The rotary embedding module every stage with layers runs, or None."""
    gpt2: bool
    """GPT-2's first stage: token plus position embeddings, then dropout."""


def import_library(directory: str | Path) -> None:
    """Import the code DIR's model runs on now: transformers, its config class
    and its modeling module (a meta-device build, no storage, dropped). That
    code is part of a rank's bare runtime, measured before any tensor of the
    model exists (`ppdsl run`'s host memory by component): about 130 MB for a
    Llama, whatever its size. Nothing when DIR cannot be built (the model's
    build then says why)."""
    try:
        meta_model(auto_config(directory))
    except ModelError:
        return


def meta_model(config: Any, where: str = "the model") -> Any:
    """The whole model of `config` on the meta device, in fp32: its modules,
    names and shapes, no storage and no initialisation (transformers skips
    `init_weights` under the meta device); tied parameters are one meta
    Parameter. `ModelError` when transformers cannot build it."""
    transformers = transformers_module()
    quiet_logging(transformers)
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except ValueError as exc:
        raise ModelError(
            f"{where}: model type {getattr(config, 'model_type', '?')!r} is not a causal LM "
            f"transformers can build: {first_line(exc)}"
        ) from exc
    except Exception as exc:
        raise ModelError(f"{where}: building the model failed: {type(exc).__name__}: {exc}") from exc
    model.train()
    return model


def load_causal_lm(directory: str | Path, seed: int = 0) -> Any:
    """The whole model from DIR, in fp32: its weights when DIR has some, else
    initialised from `seed` by `ppdsl.runtime.models.weights.materialise`'s rule
    (the same on every process, and the same tensors a pipelined run's stages
    hold); `ModelError` when DIR is no causal LM transformers can build. For
    tests and single-process tools: a run builds only its own stages."""
    model = meta_model(auto_config(directory), where_of(directory))
    with WeightFiles.open(directory) as weights:
        materialise(model, _units(model, anatomy_of(model, where_of(directory))) + [""],
                    seed, weights)
    return model


def anatomy_of(model: Any, where: str = "the model") -> Anatomy:
    """The parts of `model` to cut, from its config's `base_model_pp_plan` (or
    GPT-2's known layout); `ModelError` for an architecture that has neither."""
    config = model.config
    prefix = getattr(model, "base_model_prefix", "model")
    plan = getattr(config, "base_model_pp_plan", None)
    if getattr(config, "model_type", None) == "gpt2":
        return Anatomy((f"{prefix}.wte", f"{prefix}.wpe", f"{prefix}.drop"), f"{prefix}.h",
                       (f"{prefix}.ln_f", "lm_head"), None, gpt2=True)
    if not plan:
        raise ModelError(
            f"{where}: architecture {type(model).__name__} (model type "
            f"{getattr(config, 'model_type', '?')!r}) has no base_model_pp_plan in its config, so "
            "ppdsl does not know where to cut it; supported: GPT-2 and causal LMs with a plan "
            "(Llama, Mistral, Qwen2, Qwen3, Gemma, ...), or write a factory (docs/runtime.md)"
        )
    names = list(plan)
    lists = [n for n in names if isinstance(model.get_submodule(f"{prefix}.{n}"), nn.ModuleList)]
    if len(lists) != 1:
        raise ModelError(f"{where}: its base_model_pp_plan {names} names {len(lists)} layer lists, "
                         "not one; ppdsl cuts models with one list of decoder layers")
    at = names.index(lists[0])
    heads = [n for n in getattr(model, "_pp_plan", None) or {} if not n.startswith(f"{prefix}.")]
    head = heads[0] if heads else "lm_head"
    base = model.get_submodule(prefix)
    rotary = f"{prefix}.rotary_emb" if hasattr(base, "rotary_emb") else None
    return Anatomy(tuple(f"{prefix}.{n}" for n in names[:at]), f"{prefix}.{names[at]}",
                   tuple(f"{prefix}.{n}" for n in names[at + 1:]) + (head,), rotary, gpt2=False)


def _mask_arguments(fn: Callable[..., Any], config: Any, hidden: torch.Tensor,
                    positions: torch.Tensor) -> dict[str, Any]:
    """The keyword arguments of transformers' mask builders, as the installed
    version names them (`cache` in 5.x; `past_key_values` and `cache_position`
    before)."""
    params = inspect.signature(fn).parameters
    kwargs: dict[str, Any] = {"config": config, "attention_mask": None}
    kwargs["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = hidden
    for name in ("cache", "past_key_values"):
        if name in params:
            kwargs[name] = None
    if "cache_position" in params:
        kwargs["cache_position"] = positions[0]
    if "position_ids" in params:
        kwargs["position_ids"] = positions
    return kwargs


class HFStage(nn.Module):
    """Stage of a causal LM: the whole model's own modules for this stage (the
    embeddings on the first, `layers` in between, final norm and head on the
    last). Called with token ids (first stage) or hidden states; returns hidden
    states, or logits on the last stage."""

    def __init__(self, model: Any, anatomy: Anatomy, layers: range, first: bool,
                 last: bool) -> None:
        super().__init__()
        self.config = model.config
        self.anatomy = anatomy
        self.first, self.last = first, last
        every = model.get_submodule(anatomy.layers)
        self.layer_indices = tuple(layers)
        self.embeddings = nn.ModuleList(
            [model.get_submodule(p) for p in anatomy.embeddings] if first else [])
        self.layers = nn.ModuleList([every[i] for i in layers])
        self.finals = nn.ModuleList([model.get_submodule(p) for p in anatomy.finals] if last else [])
        self.rotary = (model.get_submodule(anatomy.rotary)
                       if anatomy.rotary is not None and len(layers) else None)
        names = {}
        for k, path in enumerate(anatomy.embeddings if first else ()):
            names[f"embeddings.{k}"] = path
        for k, i in enumerate(layers):
            names[f"layers.{k}"] = f"{anatomy.layers}.{i}"
        for k, path in enumerate(anatomy.finals if last else ()):
            names[f"finals.{k}"] = path
        self.hf_module_names = names
        """{module path in this stage: module path in the whole model}."""

    def hf_name(self, name: str) -> str:
        """The whole model's name of this stage's parameter `name`."""
        head, _, rest = name.partition(".")
        index, _, leaf = rest.partition(".")
        return f"{self.hf_module_names[f'{head}.{index}']}.{leaf}"

    def _masks(self, hidden: torch.Tensor, positions: torch.Tensor) -> list[Any]:
        from transformers import masking_utils

        types = getattr(self.config, "layer_types", None)
        sliding = getattr(self.config, "sliding_window", None) is not None and not types
        made: dict[str, Any] = {}
        masks = []
        for i in self.layer_indices:
            kind = types[i] if types else ("sliding_attention" if sliding else "full_attention")
            if kind not in made:
                fn = (masking_utils.create_sliding_window_causal_mask
                      if kind == "sliding_attention" else masking_utils.create_causal_mask)
                made[kind] = fn(**_mask_arguments(fn, self.config, hidden, positions))
            masks.append(made[kind])
        return masks

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> Any:
        """Hidden states (logits last); `positions` (documents) restart per document."""
        documents = positions is not None
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)[None]
        if self.first:
            ids = x
            if self.anatomy.gpt2:
                wte, wpe, drop = self.embeddings
                x = drop(wte(ids) + wpe(positions))
            else:
                for module in self.embeddings:
                    x = module(x)
        hidden = x
        if len(self.layers):
            extra: dict[str, Any] = {}
            if not self.anatomy.gpt2:
                extra["position_ids"] = positions
            if self.rotary is not None:
                extra["position_embeddings"] = self.rotary(hidden, positions)
            for layer, mask in zip(self.layers, self._masks(hidden, positions), strict=True):
                out = layer(hidden, attention_mask=mask, **extra)
                hidden = out[0] if isinstance(out, tuple) else out
        for module in self.finals:
            hidden = module(hidden)
        return (hidden, positions) if documents and not self.last else hidden


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Causal-LM cross-entropy, the mean over the targets (-100 at a document's end)."""
    flat = targets.reshape(-1)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), flat, ignore_index=IGNORED,
                           reduction="sum") / (flat != IGNORED).sum().clamp(min=1)


def _tied_head(model: Any, anatomy: Anatomy) -> tuple[str, str] | None:
    """(embedding parameter, head parameter) names when the LM head's weight is
    the token embedding's, else None."""
    head = model.get_submodule(anatomy.finals[-1])
    embedding = model.get_input_embeddings()
    if getattr(head, "weight", None) is None or head.weight is not embedding.weight:
        return None
    for k, path in enumerate(anatomy.embeddings):
        if model.get_submodule(path) is embedding:
            return f"embeddings.{k}.weight", f"finals.{len(anatomy.finals) - 1}.weight"
    return None


def _stage_units(anatomy: Anatomy, layers: range, first: bool, last: bool) -> list[str]:
    """The module paths a stage is made of: what `materialise` makes real for it."""
    units = list(anatomy.embeddings) if first else []
    units += [f"{anatomy.layers}.{i}" for i in layers]
    units += list(anatomy.finals) if last else []
    if anatomy.rotary is not None and len(layers):
        units.append(anatomy.rotary)
    return units


def _units(model: Any, anatomy: Anatomy) -> list[str]:
    """Every stage's modules at once: the whole model's units."""
    num_layers = len(model.get_submodule(anatomy.layers))
    return _stage_units(anatomy, range(num_layers), True, True)


class _Parts:
    """A meta-device model whose units are made real on demand, each once
    (`ppdsl.runtime.models.weights.materialise`): read from DIR's weight files
    when it has some, else initialised from the seed."""

    def __init__(self, model: Any, directory: str | Path, seed: int) -> None:
        self.model = model
        self.directory = directory
        self.seed = seed
        self.names = tensor_names(model)
        """{id of a meta tensor: its names}, taken before any is made real."""
        self.first_names = {every[0] for every in self.names.values()}
        """Each tensor's first name: a tied tensor is saved once, under it."""
        self._made: dict[int, torch.Tensor] = {}
        self._done: set[str] = set()

    def make(self, units: Sequence[str]) -> None:
        """Make `units` real (those not made yet); the weight files are open only
        meanwhile."""
        todo = [u for u in units if u not in self._done]
        if not todo:
            return
        with WeightFiles.open(self.directory) as weights:
            materialise(self.model, todo, self.seed, weights, names=self.names, made=self._made)
        self._done.update(todo)


@dataclass
class HFPipelineModel(PipelineModel):
    """A transformers causal LM as ppdsl's model protocol, with its cut and a way
    to write the trained weights back."""

    cut: tuple[int, ...] = ()
    """The first decoder layer of each stage."""
    hf_model: Any = None
    """The whole transformers model the stages are made of, on the meta device
    but for the stages built so far (`stage`), or every module after `whole()`."""
    parts: Any = None
    """What makes the model's modules real (`_Parts`)."""

    def whole(self) -> Any:
        """The whole model, every module made real (a single-process tool's, e.g.
        `--cut balanced`'s per-layer profile: a run builds only its stages)."""
        anatomy = anatomy_of(self.hf_model)
        self.parts.make(_units(self.hf_model, anatomy) + [""])
        return self.hf_model

    def save(self, out: str | Path, runner: Any) -> None:
        """Collective over `runner`'s groups: each pipeline rank writes its own
        stages' tensors (replica 0 of each, a lane-0 copy under a bidirectional
        placement, a tied tensor once) to its own shard of `out`, and pipeline
        rank 0 the index and config.json: a transformers checkpoint that
        `from_pretrained` loads; no rank gathers the model."""
        save_by_stage(self.hf_model, out, runner, self.parts.first_names)


def pipeline_model(directory: str | Path, num_stages: int,
                   options: HFOptions | None = None) -> HFPipelineModel:
    """`DIR` as ppdsl's model protocol (`ppdsl.runtime.PipelineModel`), cut into
    `num_stages` stages by `options.cut`; batches from `options.data` (or
    synthetic tokens from the seed). The model is built on the meta device; each
    stage asked for is made real then, its tensors alone read from DIR's weight
    files (or initialised from the seed), so a process holds only its own
    stages. The cut is checked on a two-layer copy of the architecture
    (`check_family`), not on the whole model."""
    options = options or HFOptions()
    where = where_of(directory)
    raw = read_config(directory)
    vocab = vocab_size_of(raw)
    data = held_out = None
    try:
        if options.data is not None and not is_documents(options.data):
            data = open_tokens(options.data, options.seq_len, vocab, options.data_dtype)
        if options.eval_data is not None:
            held_out = open_tokens(options.eval_data, options.seq_len, vocab, options.data_dtype)
    except DataError as exc:
        raise ModelError(str(exc)) from exc
    config = auto_config(directory)
    model = meta_model(config, where)
    anatomy = anatomy_of(model, where)
    num_layers = len(model.get_submodule(anatomy.layers))
    if isinstance(options.cut, str) and options.cut == "balanced":
        raise ModelError("--cut balanced is chosen by `ppdsl run` (a per-layer profile, once, "
                         "before the ranks start); to launch.py give the list it printed, "
                         "e.g. --cut 0,5,11 (or ppdsl profile --per-layer --stages N)")
    starts = parse_cut(options.cut, num_layers, num_stages)
    max_positions = getattr(model.config, "n_positions", None) or getattr(
        model.config, "max_position_embeddings", None)
    if max_positions is not None and options.seq_len > max_positions:
        raise ModelError(f"--seq-len {options.seq_len}: the model takes at most {max_positions} "
                         "positions (its config's max_position_embeddings / n_positions)")
    documents = open_batches(options, vocab, max_positions)
    check_family(config, seq_len=min(8, options.seq_len), where=where)
    vocab_size = int(model.config.vocab_size)
    ends = starts[1:] + (num_layers,)
    seq_len, seed = options.seq_len, options.seed
    parts = _Parts(model, directory, seed)

    def stage(index: int) -> HFStage:
        layers, first, last = range(starts[index], ends[index]), index == 0, index == num_stages - 1
        parts.make(_stage_units(anatomy, layers, first, last))
        return HFStage(model, anatomy, layers, first, last)

    def batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if data is not None:
            whole = torch.from_numpy(batch_tokens(data, step, batch_size, seq_len))
        else:
            g = torch.Generator().manual_seed(seed * 1_000_003 + step)
            whole = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=g)
        return whole[:, :-1].contiguous(), whole[:, 1:].contiguous()

    def eval_batch(index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert held_out is not None
        whole = torch.from_numpy(batch_tokens(held_out, index, batch_size, seq_len))
        return whole[:, :-1].contiguous(), whole[:, 1:].contiguous()

    tied = _tied_head(model, anatomy)
    ties = ({0: tied[0], num_stages - 1: tied[1]},) if tied and num_stages > 1 else ()
    return HFPipelineModel(num_stages=num_stages, stage=stage, loss=_loss, batch=batch,
                           tokens_per_sample=None if documents else seq_len, tied=ties,
                           eval_batch=eval_batch if held_out is not None else None,
                           documents=documents, cut=starts, hf_model=model, parts=parts)


_PROBE_VOCAB = 256
"""The vocabulary of `check_family`'s copy: the embedding's size says nothing
about what the base model computes around the layers."""


def check_family(config: Any, seq_len: int = 8, where: str = "the model") -> None:
    """`check_cut` on a small copy of `config`'s architecture (two decoder layers,
    or one, cut one per stage; a small vocabulary), initialised from seed 0: a
    family whose base model does more than its plan says is refused the same way
    as on the whole model, at a fraction of its memory."""
    probe = copy.deepcopy(config)
    layers = min(layer_count(config) or 1, 2)
    for key in ("num_hidden_layers", "n_layer"):
        if isinstance(getattr(probe, key, None), int):
            setattr(probe, key, layers)
    if isinstance(getattr(probe, "layer_types", None), list):
        probe.layer_types = probe.layer_types[:layers]
    vocab = min(int(getattr(config, "vocab_size", _PROBE_VOCAB)), _PROBE_VOCAB)
    probe.vocab_size = vocab
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(probe, key, None)
        if isinstance(value, int) and value >= vocab:
            setattr(probe, key, None)
    model = meta_model(probe, where)
    anatomy = anatomy_of(model, where)
    materialise(model, _units(model, anatomy) + [""], 0, None)
    stages = [HFStage(model, anatomy, range(i, i + 1), i == 0, i == layers - 1)
              for i in range(layers)]
    check_cut(model, stages, seq_len=seq_len)


def check_cut(model: Any, stages: Sequence[HFStage], seq_len: int = 8,
              rtol: float = 1e-4) -> None:
    """Run `stages` one after the other and the whole `model` on the same tokens
    (eval mode, no dropout) and raise `ModelError` when the logits differ: the cut
    does not compute the model's function."""
    vocab = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, seq_len), generator=g)
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            whole = model(input_ids=ids).logits
            x: torch.Tensor = ids
            for s in stages:
                x = s(x)
    finally:
        model.train(was)
    scale = float(whole.abs().max()) or 1.0
    error = float((whole - x).abs().max()) / scale
    if error > rtol:
        raise ModelError(
            f"{type(model).__name__}: the stages do not compute the model's logits (relative "
            f"error {error:.2e}): its base model does more than its base_model_pp_plan says; "
            "write a factory for it (docs/runtime.md)"
        )


def save_by_stage(model: Any, out: str | Path, runner: Any,
                  first_names: set[str] | None = None) -> None:
    """Write `runner`'s stages (`PipelineRunner`: its `stages`, `plan`, `rank`,
    `group`, `data_parallel`) as this pipeline rank's shard of a sharded
    safetensors checkpoint at `out`, streamed tensor by tensor
    (`ppdsl.runtime.models.weights.write_shard`); pipeline rank 0 writes the
    index and `model`'s config.json. Only replica 0 writes (sharded parameters
    are gathered one at a time over their DP group: every replica takes part);
    a stage's copy on another lane and a tensor under a name other than its
    first (`first_names`) are left to their first holder. Collective."""
    import torch.distributed as dist

    from ppdsl.runtime.execution.group import gather

    plan, group = runner.plan, runner.group
    dp = runner.data_parallel
    writes = dp is None or dist.get_rank(dp.group) == 0
    tensors: list[tuple[str, torch.Tensor]] = []
    for s, module in sorted(runner.stages.items()):
        if plan.model_stage(s) != s:
            continue  # the lane-0 copy holds the same values
        for name, t in module.state_dict(keep_vars=True).items():
            hf = module.hf_name(name)
            if first_names is None or hf in first_names:
                tensors.append((hf, t))
    folder = Path(out)
    count = plan.num_devices
    file = shard_name(runner.rank, count)
    distributed = dist.is_initialized()
    if not distributed or runner.rank == 0 and writes:
        folder.mkdir(parents=True, exist_ok=True)
        for old in list(folder.glob("model*.safetensors")) + [folder / INDEX]:
            if old.is_file():
                old.unlink()  # a former save's shards, perhaps of another count
    if distributed:
        dist.barrier()

    def whole(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t  # type: ignore[no-any-return]

    size = 0
    if writes:
        size = write_shard(folder / file, tensors, value=whole)
    elif any(hasattr(t, "full_tensor") for _, t in tensors):
        for _, t in tensors:  # replica 0's gathers need every replica
            whole(t)
    mine = ({name: file for name, _ in tensors}, size) if writes else ({}, 0)
    everyone = gather(mine, group) if distributed else [mine]
    if runner.rank == 0 and writes:
        weight_map: dict[str, str] = {}
        for names, _ in everyone:
            weight_map.update(names)
        write_index(folder, weight_map, sum(total for _, total in everyone))
        model.config.architectures = [type(model).__name__]
        model.config.dtype = torch.float32
        model.config.save_pretrained(folder)
    if distributed:
        dist.barrier()

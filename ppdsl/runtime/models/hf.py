"""Hugging Face causal language models cut into pipeline stages (`--model hf:DIR`).

`DIR` is a local folder in transformers' `save_pretrained` layout: `config.json`
and, optionally, the weights (safetensors); without weights the model is
initialised from the seed (`torch.manual_seed(seed)` then
`AutoModelForCausalLM.from_config`), the same on every rank. Nothing is
downloaded.

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

import inspect
import json
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
from ppdsl.runtime.models.model import ModelError, PipelineModel

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
    "stage_tensors",
    "save_pretrained",
]

PREFIX = "hf:"
"""The `--model` prefix naming a transformers checkpoint folder."""


def is_hf_spec(spec: str) -> bool:
    """Whether a `--model` value names a transformers folder (`hf:DIR`)."""
    return spec.startswith(PREFIX)


def _where(directory: str | Path) -> str:
    """How a message names the model of `--model hf:DIR`: as the user wrote it."""
    return f"--model {PREFIX}{directory}"


@dataclass(frozen=True)
class HFOptions:
    """How a `hf:DIR` model is trained: its sequences, data and cut."""

    seq_len: int = 64
    """Tokens per sample (`--seq-len`)."""
    seed: int = 0
    """Seed of the initial weights when DIR has none, and of synthetic tokens."""
    data: str | None = None
    """A token file (`--data`; `ppdsl.runtime.models.data`), or None for synthetic tokens."""
    data_dtype: str = "uint16"
    """Element type of a raw `.bin` token file (`--data-dtype`)."""
    cut: str | Sequence[int] = "equal"
    """`equal`, or the first decoder layer of each stage (`--cut 0,5,11`)."""
    max_seq_len: int | None = None
    """Documents (`--data FILE.npz`) cut to L tokens (`--max-seq-len`, `ppdsl.lengths`)."""
    pack: int | None = None
    """Documents packed into microbatches of at most T tokens (`--pack`)."""
    eval_data: str | None = None
    """A token file of held-out data (`--eval-data`, same format and dtype as
    `data`): evaluation batch k takes its sequences by the training batches' rule;
    None: no evaluation data (`--eval-every` is then refused)."""


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


def read_config(directory: str | Path) -> dict[str, Any]:
    """`DIR/config.json` as a dict (no transformers needed); `ModelError` when
    DIR or its config is missing or unreadable."""
    folder = Path(directory)
    where = _where(directory)
    if not folder.is_dir():
        raise ModelError(f"{where}: no such directory")
    path = folder / "config.json"
    if not path.is_file():
        raise ModelError(
            f"{where}: no config.json in {str(folder)!r}; give a folder written by "
            "transformers' save_pretrained (config.json, optionally model.safetensors)"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{where}: {str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelError(f"{where}: {str(path)!r} holds no JSON object")
    return config


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ModelError(
            f"--model {PREFIX}DIR needs the transformers package: pip install 'ppdsl[hf]'"
        ) from exc
    return transformers


_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def _has_weights(folder: Path) -> bool:
    """Whether `save_pretrained` left weights in `folder` (a token file beside them
    is no weight file)."""
    return any((folder / name).is_file() for name in _WEIGHT_FILES)


def load_causal_lm(directory: str | Path, seed: int = 0) -> Any:
    """The whole model from DIR, in fp32: its weights when DIR has some, else
    initialised from `seed` (the same on every process); `ModelError` when DIR
    is no causal LM transformers can build."""
    read_config(directory)
    transformers = _transformers()
    # progress bars and config warnings on every rank would bury the step lines
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    folder = Path(directory)
    where = _where(directory)
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as exc:
        raise ModelError(f"{where}: transformers cannot read its config.json: {exc}") from exc
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if _has_weights(folder):
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    folder, local_files_only=True, dtype=torch.float32)
            else:
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


def equal_cut(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """The first layer of each stage when layers are shared out equally (earlier
    stages take the extra ones)."""
    base, extra = divmod(num_layers, num_stages)
    starts, at = [], 0
    for s in range(num_stages):
        starts.append(at)
        at += base + (1 if s < extra else 0)
    return tuple(starts)


def parse_cut(cut: str | Sequence[int], num_layers: int, num_stages: int) -> tuple[int, ...]:
    """`equal`, or a list of each stage's first decoder layer (`0,5,11`), checked:
    `num_stages` increasing values from 0, each stage at least one layer."""
    if num_layers < num_stages:
        raise ModelError(
            f"the model has {num_layers} decoder layers, fewer than the schedule's "
            f"{num_stages} stages; every stage needs at least one layer: use fewer devices "
            "(-D d=...) or a model with more layers"
        )
    if isinstance(cut, str):
        if cut == "equal":
            return equal_cut(num_layers, num_stages)
        try:
            starts = tuple(int(x) for x in cut.split(","))
        except ValueError:
            raise ModelError(f"--cut {cut!r}: use equal, balanced or the first layer of each "
                             "stage, e.g. 0,5,11") from None
    else:
        starts = tuple(int(x) for x in cut)
    text = ",".join(map(str, starts))
    if len(starts) != num_stages:
        raise ModelError(f"--cut {text}: {len(starts)} stage starts for {num_stages} stages")
    if starts[0] != 0:
        raise ModelError(f"--cut {text}: the first stage starts at layer 0")
    ends = starts[1:] + (num_layers,)
    if any(b <= a for a, b in zip(starts, ends, strict=True)):
        raise ModelError(f"--cut {text}: each stage needs at least one of the {num_layers} layers "
                         "(strictly increasing starts, all below the layer count)")
    return starts


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


@dataclass
class HFPipelineModel(PipelineModel):
    """A transformers causal LM as ppdsl's model protocol, with its cut and a way
    to write the trained weights back."""

    cut: tuple[int, ...] = ()
    """The first decoder layer of each stage."""
    hf_model: Any = None
    """The whole transformers model the stages are made of."""

    def save(self, out: str | Path, stages: dict[int, nn.Module]) -> None:
        """Collective over the default group: every process offers its `stages`
        (`{stage: module}`, a runner's); process 0 writes the whole model to `out`
        as a transformers checkpoint."""
        _save_collective(self.hf_model, out, stages)


def _layer_count(config: Any) -> int | None:
    for key in ("num_hidden_layers", "n_layer"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def _vocab_size(config: dict[str, Any]) -> int | None:
    """The vocabulary size a config.json states (at its top or in `text_config`)."""
    value = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(value) if isinstance(value, int) else None


def preflight(directory: str | Path, num_stages: int,
              options: HFOptions) -> tuple[int, ...] | None:
    """What can be checked without building the model, before any process starts
    (`ppdsl run`): the folder and its config, an architecture ppdsl can cut,
    enough decoder layers for the stages and the cut, the sequence length, the
    token file. Returns the cut (None for `balanced`, which needs a profile).
    Raises `ModelError` saying what is wrong."""
    raw = read_config(directory)
    transformers = _transformers()
    transformers.utils.logging.set_verbosity_error()
    where = _where(directory)
    try:
        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    except Exception as exc:
        raise ModelError(f"{where}: transformers cannot read its config.json: "
                         f"{first_line(exc)}") from exc
    model_type = getattr(config, "model_type", "?")
    if model_type != "gpt2" and not getattr(config, "base_model_pp_plan", None):
        raise ModelError(
            f"{where}: model type {model_type!r} has no base_model_pp_plan in its config, so "
            "ppdsl does not know where to cut it; supported: GPT-2 and causal LMs with a plan "
            "(Llama, Mistral, Qwen2, Qwen3, Gemma, ...), or write a factory (docs/runtime.md)"
        )
    layers = _layer_count(config)
    if layers is None:
        raise ModelError(f"{where}: its config gives no layer count (num_hidden_layers or n_layer)")
    balanced = isinstance(options.cut, str) and options.cut == "balanced"
    cut = None if balanced else parse_cut(options.cut, layers, num_stages)
    if balanced and layers < num_stages:
        parse_cut("equal", layers, num_stages)  # the same message as any cut
    max_positions = getattr(config, "n_positions", None) or getattr(
        config, "max_position_embeddings", None)
    if max_positions is not None and options.seq_len > max_positions:
        raise ModelError(f"--seq-len {options.seq_len}: the model takes at most {max_positions} "
                         "positions (its config's max_position_embeddings / n_positions)")
    open_batches(options, _vocab_size(raw), max_positions)
    for path in (options.data, options.eval_data):
        if path is not None and not is_documents(path):
            try:
                open_tokens(path, options.seq_len, _vocab_size(raw), options.data_dtype)
            except DataError as exc:
                raise ModelError(str(exc)) from exc
    return cut


def pipeline_model(directory: str | Path, num_stages: int,
                   options: HFOptions | None = None) -> HFPipelineModel:
    """`DIR` as ppdsl's model protocol (`ppdsl.runtime.PipelineModel`), cut into
    `num_stages` stages by `options.cut`; batches from `options.data` (or
    synthetic tokens from the seed). Every process that calls it builds the whole
    model once (then each stage it is asked for is the whole model's modules)."""
    options = options or HFOptions()
    where = _where(directory)
    raw = read_config(directory)
    vocab = _vocab_size(raw)
    data = held_out = None
    try:
        if options.data is not None and not is_documents(options.data):
            data = open_tokens(options.data, options.seq_len, vocab, options.data_dtype)
        if options.eval_data is not None:
            held_out = open_tokens(options.eval_data, options.seq_len, vocab, options.data_dtype)
    except DataError as exc:
        raise ModelError(str(exc)) from exc
    model = load_causal_lm(directory, options.seed)
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
    vocab_size = int(model.config.vocab_size)
    ends = starts[1:] + (num_layers,)
    seq_len, seed = options.seq_len, options.seed

    def stage(index: int) -> HFStage:
        return HFStage(model, anatomy, range(starts[index], ends[index]), index == 0,
                       index == num_stages - 1)

    check_cut(model, [stage(s) for s in range(num_stages)], seq_len=min(8, options.seq_len))

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
                           documents=documents, cut=starts, hf_model=model)


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


def stage_tensors(stages: dict[int, Any]) -> dict[str, torch.Tensor]:
    """This process's stage parameters under the whole model's names, as CPU
    copies (a sharded parameter gathered over its group: collective then)."""
    found: dict[str, torch.Tensor] = {}
    for _, module in sorted(stages.items()):
        for name, p in module.named_parameters():
            whole = p.full_tensor() if hasattr(p, "full_tensor") else p
            found[module.hf_name(name)] = whole.detach().to("cpu", copy=True)
    return found


def save_pretrained(model: Any, out: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write `tensors` (whole-model names, every parameter) as a transformers
    checkpoint at `out`: a fresh model of `model`'s class and config (the
    training one's modules may be sharded: FSDP2 turns their parameters into
    DTensors) takes the values and `save_pretrained` writes it (a tied head is
    one tensor there). The global RNG is left as it was. `ModelError` when a
    parameter is missing."""
    with torch.random.fork_rng(devices=[]):
        fresh = type(model)(model.config)
    expected = {name for name, _ in fresh.named_parameters()}
    missing = sorted(expected - set(tensors))
    if missing:
        raise ModelError(f"--save-model: no trained values for {', '.join(missing[:5])}")
    with torch.no_grad():
        for name, value in tensors.items():
            fresh.get_parameter(name).copy_(value)
    fresh.save_pretrained(out)


def _save_collective(model: Any, out: str | Path, stages: dict[int, nn.Module]) -> None:
    """Every process offers its stages' parameters; process 0 writes `out`."""
    import torch.distributed as dist

    from ppdsl.runtime.execution.group import gather

    mine = stage_tensors(stages)
    if not dist.is_initialized():
        save_pretrained(model, out, mine)
        return
    everyone = gather(mine)
    if dist.get_rank() == 0:
        merged: dict[str, torch.Tensor] = {}
        for part in everyone:
            merged.update(part)
        save_pretrained(model, out, merged)
    dist.barrier()

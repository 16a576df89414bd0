"""What a `--model hf:DIR` folder's config.json says, before any model is built:
the options a `hf:` model is trained with, the config read with and without
transformers, the cut into stages (`equal_cut`, `parse_cut`) and `preflight`,
which `ppdsl run` calls before any process starts. `ppdsl.runtime.models.hf`
builds and cuts the model itself.

`transformers` is an optional dependency (`pip install ppdsl[hf]`); it is
imported only when a `hf:` model is used.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppdsl.runtime.errors import first_line
from ppdsl.runtime.models.data import DataError, open_tokens
from ppdsl.runtime.models.documents import is_documents, open_batches
from ppdsl.runtime.models.model import ModelError

__all__ = [
    "HFOptions",
    "PREFIX",
    "is_hf_spec",
    "read_config",
    "equal_cut",
    "parse_cut",
    "preflight",
    "where_of",
    "transformers_module",
    "quiet_logging",
    "auto_config",
    "layer_count",
    "vocab_size_of",
]


PREFIX = "hf:"
"""The `--model` prefix naming a transformers checkpoint folder."""


def is_hf_spec(spec: str) -> bool:
    """Whether a `--model` value names a transformers folder (`hf:DIR`)."""
    return spec.startswith(PREFIX)


def where_of(directory: str | Path) -> str:
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


def read_config(directory: str | Path) -> dict[str, Any]:
    """`DIR/config.json` as a dict (no transformers needed); `ModelError` when
    DIR or its config is missing or unreadable."""
    folder = Path(directory)
    where = where_of(directory)
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


def transformers_module() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ModelError(
            f"--model {PREFIX}DIR needs the transformers package: pip install 'ppdsl[hf]'"
        ) from exc
    return transformers


def quiet_logging(transformers: Any) -> None:
    """Progress bars and config warnings on every rank would bury the step lines."""
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def auto_config(directory: str | Path) -> Any:
    """DIR's config as transformers reads it; `ModelError` when it cannot."""
    read_config(directory)
    transformers = transformers_module()
    quiet_logging(transformers)
    try:
        return transformers.AutoConfig.from_pretrained(Path(directory), local_files_only=True)
    except Exception as exc:
        raise ModelError(f"{where_of(directory)}: transformers cannot read its config.json: "
                         f"{first_line(exc)}") from exc


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


def layer_count(config: Any) -> int | None:
    for key in ("num_hidden_layers", "n_layer"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def vocab_size_of(config: dict[str, Any]) -> int | None:
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
    transformers = transformers_module()
    transformers.utils.logging.set_verbosity_error()
    where = where_of(directory)
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
    layers = layer_count(config)
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
    open_batches(options, vocab_size_of(raw), max_positions)
    for path in (options.data, options.eval_data):
        if path is not None and not is_documents(path):
            try:
                open_tokens(path, options.seq_len, vocab_size_of(raw), options.data_dtype)
            except DataError as exc:
                raise ModelError(str(exc)) from exc
    return cut

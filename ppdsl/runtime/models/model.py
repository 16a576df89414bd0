"""The model protocol: what `--model path_or_module:factory` must name.

`factory(num_stages)` returns a `PipelineModel` (or any object with the same
four members):

- ``num_stages``: how many stages it built the model into (must equal the schedule's);
- ``stage(index) -> torch.nn.Module``: stage `index` of `num_stages`, built with the same
  weights on every rank (initialise from a seed, not from the global RNG state);
- ``loss(output, target) -> scalar``: a *mean* loss over the batch, so that the sum over
  m microbatches of ``loss(mb) / m`` equals the loss of the whole batch;
- ``batch(step, batch_size) -> (inputs, targets)``: the same tensors for the same step
  wherever it is called (only the ranks holding the first or the last stage call it);
  dimension 0 is the sample dimension and is split into microbatches; either may be
  a tensor or a tuple/dict of tensors.

and optionally ``tokens_per_sample`` (inputs are tokens: report tokens/s),
``tied`` (parameters shared between stages), ``eval_batch(index,
batch_size) -> (inputs, targets)`` (held-out data for `--eval-every`) and
``documents`` (microbatches of varying length, each step's from a document
file: `ppdsl.runtime.models.documents`; `batch` is then not called).

`split_layers` cuts a list of layers into contiguous, balanced stages.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppdsl.runtime.errors import LossError, ModelError

__all__ = ["PipelineModel", "ModelError", "LossError", "load_factory", "build_model", "split_layers"]


@dataclass
class PipelineModel:
    """A model cut into stages, with its loss and its data."""

    num_stages: int
    """How many stages `stage` can build."""
    stage: Callable[[int], Any]
    """`stage(index)` builds stage `index` (a torch.nn.Module)."""
    loss: Callable[[Any, Any], Any]
    """`loss(output, target)`: mean loss of a batch (or microbatch)."""
    batch: Callable[[int, int], tuple[Any, Any]]
    """`batch(step, batch_size) -> (inputs, targets)`, the same for a step wherever
    it is called (only the ranks holding the first or the last stage call it)."""
    tokens_per_sample: int | None = None
    """When the inputs are tokens: how many one sample holds (throughput is then
    also reported in tokens/s); None for other inputs (samples/s only)."""
    tied: tuple[dict[int, str], ...] = ()
    """Parameters shared between stages, each {stage: parameter name in that
    stage's module} (e.g. a tied embedding and vocabulary head): their gradients
    are summed over the owning ranks."""
    eval_batch: Callable[[int, int], tuple[Any, Any]] | None = None
    """`eval_batch(index, batch_size) -> (inputs, targets)`: evaluation batch
    `index` (0 .. --eval-batches - 1), held out from training, the same wherever
    it is called; None: the model has no evaluation data (`--eval-every` then
    stops at start-up)."""
    documents: Any = None
    """Documents as microbatches of varying length
    (`ppdsl.runtime.models.documents.DocumentBatches`), or None: the step's
    batch comes from `batch` and every microbatch has the same shape."""


def split_layers(layers: Sequence[Any], num_stages: int) -> list[list[Any]]:
    """Cut `layers` into `num_stages` contiguous groups whose sizes differ by at most
    one (earlier stages get the extra layers)."""
    if num_stages < 1:
        raise ModelError(f"num_stages must be at least 1, got {num_stages}")
    if len(layers) < num_stages:
        raise ModelError(
            f"cannot split {len(layers)} layers into {num_stages} stages; "
            "build the model with at least as many layers as stages"
        )
    base, extra = divmod(len(layers), num_stages)
    groups, start = [], 0
    for i in range(num_stages):
        size = base + (1 if i < extra else 0)
        groups.append(list(layers[start : start + size]))
        start += size
    return groups


def _where(exc: BaseException) -> str:
    """` at FILE:LINE`: where in the user's code `exc` was raised: the innermost
    frame outside ppdsl, the import machinery and installed packages (for a
    syntax error, its own line)."""
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        return f" at {exc.filename}:{exc.lineno}"
    skipped = (str(Path(__file__).resolve().parents[2]), sys.base_prefix, sys.prefix)
    found = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        name = frame.filename
        if name.startswith("<") or "site-packages" in name or name.startswith(skipped):
            continue
        found = f" at {name}:{frame.lineno}"
    return found


def load_factory(spec: str) -> Callable[[int], Any]:
    """`path/to/file.py:factory` or `package.module:factory` -> the callable."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ModelError(
            f"--model {spec!r}: expected FILE.py:FACTORY or MODULE:FACTORY, "
            "e.g. examples/models/tiny_gpt.py:stages"
        )
    if target.endswith(".py") or "/" in target:
        path = Path(target)
        if not path.is_file():
            raise ModelError(f"--model {spec!r}: no such file: {str(path)!r}")
        mod_name = f"_ppdsl_user_model_{abs(hash(str(path.resolve())))}"
        file_spec = importlib.util.spec_from_file_location(mod_name, path)
        if file_spec is None or file_spec.loader is None:
            raise ModelError(f"--model {spec!r}: cannot load {str(path)!r} as Python")
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[mod_name] = module
        try:
            file_spec.loader.exec_module(module)
        except Exception as exc:
            raise ModelError(
                f"--model {spec!r}: importing {str(path)!r} failed{_where(exc)}: {exc!r}"
            ) from exc
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ModelError(f"--model {spec!r}: cannot import module {target!r}: {exc}") from exc
        except Exception as exc:
            raise ModelError(
                f"--model {spec!r}: importing module {target!r} failed{_where(exc)}: {exc!r}"
            ) from exc
    factory = getattr(module, name, None)
    if factory is None or not callable(factory):
        raise ModelError(f"--model {spec!r}: {target!r} has no callable named {name!r}")
    return factory


def build_model(spec: str, num_stages: int) -> Any:
    """Load the factory, call it, and check that the result follows the protocol."""
    factory = load_factory(spec)
    try:
        model = factory(num_stages)
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError(
            f"--model {spec!r}: factory({num_stages}) failed{_where(exc)}: {exc!r}"
        ) from exc
    missing = [m for m in ("num_stages", "stage", "loss", "batch") if not hasattr(model, m)]
    if missing:
        raise ModelError(
            f"--model {spec!r}: factory returned {type(model).__name__}, which lacks "
            f"{', '.join(missing)} (see docs/runtime.md: return a ppdsl.runtime.PipelineModel)"
        )
    if model.num_stages != num_stages:
        raise ModelError(
            f"--model {spec!r}: factory built {model.num_stages} stages but the schedule has "
            f"{num_stages}; the factory must cut the model into the number of stages it is given"
        )
    return model

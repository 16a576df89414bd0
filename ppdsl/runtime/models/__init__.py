"""What the user brings (docs/runtime.md, "Your model"): the model protocol and
`--model module:factory`, transformers' models from `--model hf:DIR`, token files
from `--data`. Importing this face does not import torch (`ppdsl run` reads it
before it starts torchrun)."""

from __future__ import annotations

from ppdsl.runtime._lazy import lazy_getattr
from ppdsl.runtime.errors import LossError, ModelError
from ppdsl.runtime.models.model import PipelineModel, build_model, load_factory, split_layers

__all__ = ["PipelineModel", "ModelError", "LossError", "build_model", "load_factory",
           "split_layers", "HFOptions", "pipeline_model", "is_hf_spec"]

__getattr__ = lazy_getattr(__name__, {
    "HFOptions": "hf",
    "pipeline_model": "hf",
    "is_hf_spec": "hf",
})

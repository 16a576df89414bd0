"""The values each option of `ppdsl run` and `ppdsl profile` takes, one tuple
each, named once for the command line and for the code that acts on them. The
bottom of ppdsl.runtime beside `errors`, importing no torch: the rooms use
them, and the commands declare their flags with them before torch loads."""

from __future__ import annotations

from ppdsl.semantics import DP_MODES

__all__ = ["DEVICES", "RELEASES", "OPTIMIZERS", "LR_SCHEDULES", "VALIDATIONS", "PRECISIONS",
           "DP_MODES", "DATA_DTYPES", "CUT_RULES", "PARAM_DTYPES", "REDUCE_DTYPES"]

DEVICES = ("auto", "cpu", "cuda")
"""`--device`: auto (CUDA with a GPU per local rank, else CPU), cpu, cuda."""
RELEASES = ("at-b", "at-w")
"""`--release`: when a split backward frees a microbatch's activations."""
OPTIMIZERS = ("sgd", "adam", "adamw")
"""`--optimizer`: the torch.optim classes `make_optimizer` builds."""
LR_SCHEDULES = ("constant", "warmup-cosine")
"""`--lr-schedule`: the factors `lr_lambda` returns."""
VALIDATIONS = ("sync", "post")
"""`--optimizer-validation`: check the gradients before the step, or after it
(the zero-bubble paper's post-validation)."""
PRECISIONS = ("fp32", "bf16", "fp16")
"""`--precision`: fp32, or the forward and loss under bf16/fp16 autocast."""
PARAM_DTYPES = ("fp32", "bf16")
"""`--param-dtype`: the dtype the stages' parameters are kept and computed in
(the optimizer steps fp32 master weights either way)."""
REDUCE_DTYPES = ("fp32", "bf16")
"""`--reduce-dtype`: the dtype data parallelism reduces gradients in."""
DATA_DTYPES = ("uint16", "uint32")
"""`--data-dtype`: the element type of a raw .bin token file."""
CUT_RULES = ("equal", "balanced")
"""`--cut`'s named rules (besides a list of each stage's first layer)."""

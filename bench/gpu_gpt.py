"""A GPT-style model for `make gpu-check` (bench/gpu_check.py), sized by the
environment so one file serves the CPU run (small) and the GPU one (hidden 2048
to 4096, sequence 2048):

    PPDSL_GPT_HIDDEN (256), PPDSL_GPT_SEQ (128), PPDSL_GPT_LAYERS (8),
    PPDSL_GPT_HEADS (hidden / 128, at least 2)

`stages(n)`: the transformer blocks only, cut into n stages (pre-norm attention
with scaled_dot_product_attention, a 4h GELU MLP), every stage alike, so a
stage's M_B is the same everywhere (the compiler's memory model in bytes is then
its units times one stage's measured M_B). The inputs are hidden states, the
loss the mean square of the last stage's output against a target.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from ppdsl.runtime import PipelineModel, split_layers


def _sizes() -> tuple[int, int, int, int]:
    hidden = int(os.environ.get("PPDSL_GPT_HIDDEN", "256"))
    seq = int(os.environ.get("PPDSL_GPT_SEQ", "128"))
    layers = int(os.environ.get("PPDSL_GPT_LAYERS", "8"))
    heads = int(os.environ.get("PPDSL_GPT_HEADS", str(max(hidden // 128, 2))))
    return hidden, seq, layers, heads


class Block(nn.Module):
    """Pre-norm causal attention + MLP (the zero-bubble paper's transformer layer,
    with fused attention: no 5as^2b term)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(h, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, h // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, h))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def _block(index: int, hidden: int, heads: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4321 + index)
        block = Block(hidden, heads)
    return block


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean square error, in fp32."""
    return ((output.float() - target) ** 2).mean()


def stages(num_stages: int) -> PipelineModel:
    """The blocks cut into `num_stages` stages."""
    hidden, seq, layers, heads = _sizes()
    groups = split_layers(list(range(layers)), num_stages)

    def stage(index: int) -> nn.Module:
        return nn.Sequential(*(_block(i, hidden, heads) for i in groups[index]))

    def batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(97 + step)
        return (torch.randn(batch_size, seq, hidden, generator=g),
                torch.randn(batch_size, seq, hidden, generator=g))

    return PipelineModel(num_stages=num_stages, stage=stage, loss=loss, batch=batch)

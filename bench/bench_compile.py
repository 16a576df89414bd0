"""torch.compile and the B/W split (issue 20, point 9): one stage of two GPT blocks
(bench/gpu_gpt.py) three ways, measured by `ppdsl.runtime.measure.stages.measure_stage`:

- eager: every linear split (B computes dx, W dW);
- whole block compiled (``torch.compile(block)``): the compiled region is ONE
  autograd node, so the split cannot look inside; B computes every weight
  gradient and W is empty (every parameter "uncovered");
- pieces compiled: the linears stay eager, what lies between them (layer norms,
  the attention core, the GELU) is compiled: the split is kept for every linear
  (the compiled layer norms' parameters are "uncovered": B computes them, where
  the runtime's default, norms="in-b", computes layer norms' gradients anyway).

The supported way to compile a stage that a split schedule runs is the third
(or a fused, BW, schedule for a compiled stage). On CPU the bench compiles with
the "aot_eager" backend (the same autograd structure as inductor, without its
minutes of C++ compilation on a shared machine), on CUDA with "inductor". Times
in ms (CPU: this thread's CPU time; CUDA: CUDA events), medians. The runtime
names a compiled region's parameters at start-up, with what to do.

Measured (CPU, 2 cores shared with other work, aot_eager, --quick): eager T_W
7.23 ms, (I+W)/B 1.083, 0 of 24 uncovered; whole block compiled T_W 0.04 ms
(W empty), (I+W)/B 1.348, 24 of 24; pieces compiled T_W 9.73 ms, (I+W)/B
1.028, 8 of 24 (the norms)."""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from bench.gpu_gpt import Block
from ppdsl.runtime.execution.split import uncovered_parameters
from ppdsl.runtime.measure.stages import measure_stage


class _PiecesBlock(nn.Module):
    """A Block whose linears stay eager and whose other pieces are compiled."""

    def __init__(self, block: Block, backend: str) -> None:
        super().__init__()
        self.block = block
        self.norm1 = torch.compile(block.norm1, backend=backend)
        self.norm2 = torch.compile(block.norm2, backend=backend)
        self.attention = torch.compile(_attention, backend=backend)
        self.gelu = torch.compile(F.gelu, backend=backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.block
        att = self.attention(b.qkv(self.norm1(x)), b.heads)
        x = x + b.proj(att)
        return x + b.down(self.gelu(b.up(self.norm2(x))))


def _attention(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    b, t, h3 = qkv.shape
    h = h3 // 3
    q, k, v = (z.reshape(b, t, heads, h // heads).transpose(1, 2) for z in qkv.split(h, dim=-1))
    att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return att.transpose(1, 2).reshape(b, t, h)


def _stage(way: str, hidden: int, heads: int, backend: str, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    blocks = [Block(hidden, heads).to(device) for _ in range(2)]
    if way == "whole block compiled":
        return nn.Sequential(*(torch.compile(b, backend=backend) for b in blocks))
    if way == "pieces compiled":
        return nn.Sequential(*(_PiecesBlock(b, backend) for b in blocks))
    return nn.Sequential(*blocks)


def main() -> None:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    backend = "inductor" if cuda else "aot_eager"
    hidden, seq = (2048, 2048) if cuda else (256, 128)
    heads = max(hidden // 128, 2)
    if not cuda:
        torch.set_num_threads(1)
    quick = "--quick" in sys.argv
    warmup, repeats = (2, 3) if quick else (3, 10)
    print(f"two GPT blocks, hidden {hidden}, sequence {seq}, microbatch 1, {device}, "
          f"torch.compile backend {backend}; ms ({'CUDA events' if cuda else 'thread CPU time'})")
    print(f"{'way':<22} {'T_F':>8} {'T_B':>8} {'T_I':>8} {'T_W':>8} {'(I+W)/B':>8} {'uncovered':>10}")
    for way in ("eager", "whole block compiled", "pieces compiled"):
        stage = _stage(way, hidden, heads, backend, device)
        x = torch.randn(1, seq, hidden, device=device)
        grad = torch.randn(1, seq, hidden, device=device)
        t = measure_stage(stage, lambda x=x: x, lambda y: y, grad, device, warmup=warmup,
                          repeats=repeats, clock=time.thread_time if not cuda else time.perf_counter)
        uncovered = uncovered_parameters(stage, x)
        total = sum(1 for _ in stage.parameters())
        print(f"{way:<22} {t.forward_ms:8.2f} {t.fused_ms:8.2f} {t.input_ms:8.2f} {t.weight_ms:8.2f} "
              f"{t.backward_ratio:8.3f} {len(uncovered):>4} of {total:<3}")

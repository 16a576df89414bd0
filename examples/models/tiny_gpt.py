"""A small decoder-only transformer for pipeline tests and the demo.

`stages(num_stages)` follows ppdsl's model protocol (docs/runtime.md): it cuts
16 transformer blocks into `num_stages` contiguous stages (1, 2, 4, 8 or 16 of
them; any count up to 16 works), the token and position embeddings riding on the
first stage and the final norm and vocabulary head on the last. Every block is
initialised from its own seed, so each rank builds identical weights for the
stages it holds without building the others.

    ppdsl run examples/zb_v.pp -D d=4 -D m=8 --model examples/models/tiny_gpt.py:stages
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ppdsl.runtime import PipelineModel, split_layers

VOCAB = 64
DIM = 32
HEADS = 2
SEQ = 16
LAYERS = 16
SEED = 1234


class Block(nn.Module):
    """Pre-norm attention + MLP, causal. `explicit_attention` computes softmax(q k^T)
    v step by step, so autograd keeps the heads x seq x seq probabilities as an
    unfused attention does (the zero-bubble paper's 5as^2b term of M_B, which B
    frees); otherwise a fused scaled_dot_product_attention."""

    def __init__(self, explicit_attention: bool = False, heads: int = HEADS,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.explicit_attention = explicit_attention
        self.heads = heads
        self.dropout = dropout
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(DIM, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, DIM // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.explicit_attention:
            scores = q.matmul(k.transpose(-2, -1)) * (DIM // self.heads) ** -0.5
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            att = scores.masked_fill(mask, float("-inf")).softmax(-1).matmul(v)
        else:
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, DIM))
        h = self.down(F.gelu(self.up(self.norm2(x))))
        if self.dropout:  # draws from the global RNG: what a checkpoint must restore
            h = F.dropout(h, self.dropout, training=self.training)
        return x + h


class Embed(nn.Module):
    def __init__(self, seq: int = SEQ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, DIM)
        self.positions = nn.Embedding(seq, DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.tokens(ids) + self.positions(pos)


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def _layer(index: int, seq: int = SEQ, explicit_attention: bool = False,
           heads: int = HEADS, dropout: float = 0.0) -> nn.Module:
    """Layer `index` of [embed, block 0..LAYERS-1, head], from its own seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED + index)
        if index == 0:
            return Embed(seq)
        if index == LAYERS + 1:
            return Head()
        return Block(explicit_attention, heads, dropout)


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy."""
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batch(step: int, batch_size: int, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of an affine recurrence mod VOCAB (learnable), seeded by the step."""
    g = torch.Generator().manual_seed(SEED * 7919 + step)
    start = torch.randint(0, VOCAB, (batch_size, 1), generator=g)
    mult = torch.randint(1, 4, (batch_size, 1), generator=g) * 2 + 1
    tokens = [start]
    for _ in range(seq):
        tokens.append((tokens[-1] * mult + 7) % VOCAB)
    whole = torch.cat(tokens, dim=1)
    return whole[:, :-1].contiguous(), whole[:, 1:].contiguous()


def _model(num_stages: int, seq: int, explicit_attention: bool, heads: int,
           dropout: float = 0.0, tied: bool = False) -> PipelineModel:
    groups = split_layers(list(range(1, LAYERS + 1)), num_stages)
    groups[0].insert(0, 0)
    groups[-1].append(LAYERS + 1)

    def stage(index: int) -> nn.Module:
        module = nn.Sequential(
            *(_layer(i, seq, explicit_attention, heads, dropout) for i in groups[index])
        )
        if tied and index == num_stages - 1:  # the head starts as the token embedding
            head = module[len(groups[index]) - 1]
            tokens = module[0].tokens.weight if num_stages == 1 else _layer(0, seq).tokens.weight
            head.out.weight = tokens
        return module

    def batch_of(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return batch(step, batch_size, seq)

    def eval_batch_of(index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return batch(-1 - index, batch_size, seq)  # held out: no training step's seed

    ties: tuple[dict[int, str], ...] = ()
    if tied and num_stages > 1:
        ties = ({0: "0.tokens.weight", num_stages - 1: f"{len(groups[-1]) - 1}.out.weight"},)
    return PipelineModel(num_stages=num_stages, stage=stage, loss=loss, batch=batch_of,
                         tokens_per_sample=seq, tied=ties, eval_batch=eval_batch_of)


def stages(num_stages: int) -> PipelineModel:
    """The protocol's factory: the model cut into `num_stages` stages (16 tokens,
    fused attention: small and fast, for tests)."""
    return _model(num_stages, SEQ, explicit_attention=False, heads=HEADS)


def stages_long(num_stages: int) -> PipelineModel:
    """The same weights on 128-token sequences with unfused 8-head attention: the
    heads x seq^2 probabilities dominate the activations, as in the zero-bubble
    paper's regime (its 5as^2b term), so B frees most of a microbatch's
    memory (measured M_W/M_B about 0.14 rather than about 0.43 for `stages`; 0.19
    and 0.56 when W also takes the layer norms' weight gradients, norms="deferred")."""
    return _model(num_stages, 128, explicit_attention=True, heads=8)


FROZEN = ("qkv.weight", "proj.weight", "up.weight", "down.weight", "tokens.weight")


def stages_frozen(num_stages: int) -> PipelineModel:
    """LoRA-style fine-tuning: `stages` with every block's attention and MLP weights
    and the token embedding frozen (requires_grad=False); the biases, norms,
    position embedding and head train."""
    model = stages(num_stages)

    def stage(index: int) -> nn.Module:
        module = model.stage(index)
        for name, p in module.named_parameters():
            if name.endswith(FROZEN):
                p.requires_grad_(False)
        return module

    return PipelineModel(num_stages=num_stages, stage=stage, loss=model.loss, batch=model.batch,
                         tokens_per_sample=model.tokens_per_sample)


def stages_tied(num_stages: int) -> PipelineModel:
    """`stages` with the vocabulary head's weight tied to the token embedding (one
    parameter in the model; on two ranks, its gradient summed over both)."""
    return _model(num_stages, SEQ, explicit_attention=False, heads=HEADS, tied=True)


def stages_dropout(num_stages: int) -> PipelineModel:
    """`stages` with dropout 0.1 after every MLP: a step draws from the global RNG
    (what resuming from a checkpoint must restore to continue bit for bit)."""
    return _model(num_stages, SEQ, explicit_attention=False, heads=HEADS, dropout=0.1)

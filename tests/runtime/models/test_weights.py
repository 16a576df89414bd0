"""A model's tensors a part at a time (ppdsl/runtime/models/weights.py): stages
made real from a meta-device model hold the whole model's tensors, read only
their own from one or several safetensors files, and a shard written by
`write_shard` reads back as safetensors writes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dist import hf_models

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from ppdsl.runtime.models import weights  # noqa: E402
from ppdsl.runtime.models.hf import HFOptions, load_causal_lm, pipeline_model  # noqa: E402


def _stage_tensors(model, order) -> dict:
    """{whole-model name: tensor} of the stages built in `order` (each made real then)."""
    found = {}
    for s in order:
        stage = model.stage(s)
        for name, t in stage.state_dict().items():
            found[stage.hf_name(name)] = t
    return found


@pytest.mark.slow
def test_stages_equal_the_whole_model_built_from_the_seed(tmp_path: Path) -> None:
    """Without weights, every tensor of every stage, at d=2 and d=4, built in either
    order and one stage twice (a bidirectional placement's copies), equals the
    whole model's under the same seed (the last stage alone too, as a rank
    holding only it builds it); the tied head of Qwen2 on the last stage
    equals the embedding on the first; nothing is left on the meta device."""
    for family in hf_models.FAMILIES:
        folder = hf_models.write(tmp_path, family, weights=False)
        whole = load_causal_lm(folder, seed=5).state_dict()
        for d, order in ((2, [1]), (2, [1, 0]), (4, [3, 1, 2, 0, 2])):
            model = pipeline_model(folder, d, HFOptions(seq_len=8, seed=5))
            found = _stage_tensors(model, order)
            assert not any(t.is_meta for t in found.values()), family
            for name, t in found.items():
                assert torch.equal(t, whole[name]), (family, d, name)
            if family == "qwen2":
                head = model.stage(d - 1).finals[-1].weight
                assert torch.equal(head, whole["model.embed_tokens.weight"])
        other = load_causal_lm(folder, seed=6).state_dict()
        assert not torch.equal(other["lm_head.weight"], whole["lm_head.weight"]), family


def test_seeded_tensors_follow_the_models_own_rule(tmp_path: Path) -> None:
    """The seeded whole model holds what its `_init_weights` makes: norms at one,
    linear and embedding weights of the config's standard deviation, each module
    different from every other (a seed per module name), and logits a from_config
    model with the same state computes (buffers such as rotary frequencies made)."""
    folder = hf_models.write(tmp_path, "llama", weights=False)
    model = load_causal_lm(folder, seed=1)
    std = model.config.initializer_range
    seen = set()
    for name, p in model.state_dict().items():
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert abs(float(p.std()) - std) < 0.25 * std, (name, float(p.std()))
            key = tuple(p.reshape(-1)[:4].tolist())
            assert key not in seen, name
            seen.add(key)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, hf_models.VOCAB, (2, 8))
    model.eval()
    reference.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_each_stage_reads_only_its_tensors_from_two_shards(tmp_path: Path, monkeypatch) -> None:
    """A checkpoint `save_pretrained` wrote as several shards with an index: each
    stage at d=2 reads exactly its own tensors (the tied head from the embedding's
    entry) and computes, stage after stage, the logits of `from_pretrained`'s
    model."""
    read: list[str] = []
    real_get = weights.WeightFiles.get
    monkeypatch.setattr(weights.WeightFiles, "get",
                        lambda self, name: read.append(name) or real_get(self, name))
    embedding = {"qwen2": "model.embed_tokens.weight", "gpt2": "transformer.wte.weight"}
    for family in ("qwen2", "gpt2"):
        cfg = hf_models.config(family)
        torch.manual_seed(7)
        source = transformers.AutoModelForCausalLM.from_config(cfg)
        folder = tmp_path / family
        source.save_pretrained(folder, max_shard_size="20KB")
        index = json.loads((folder / weights.INDEX).read_text())
        assert len(set(index["weight_map"].values())) >= 2
        stages = []
        for s in (0, 1):  # each built as the one rank holding it builds it
            read.clear()
            stage = pipeline_model(folder, 2, HFOptions(seq_len=8)).stage(s)
            stages.append(stage)
            own = {stage.hf_name(n) for n in stage.state_dict()}
            # a tied head is saved once, as the embedding
            own = {n if n in index["weight_map"] else embedding[family] for n in own}
            assert sorted(read) == sorted(own), (family, s)
        reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        ids = torch.randint(0, hf_models.VOCAB, (2, 8))
        reference.eval()
        x = ids
        with torch.no_grad():
            for stage in stages:
                x = stage.eval()(x)
            assert torch.equal(x, reference(input_ids=ids).logits), family


def test_written_shard_reads_back_with_safe_open(tmp_path: Path) -> None:
    """`write_shard` writes the safetensors format: safe_open reads every tensor
    back equal (float, bf16, integer, 0-dim and empty ones) with its metadata, and
    the function returns the data's byte count."""
    from safetensors import safe_open

    tensors = [("a.weight", torch.randn(3, 5)), ("b", torch.arange(7)),
               ("c", torch.randn(4).to(torch.bfloat16)), ("scalar", torch.tensor(2.5)),
               ("empty", torch.zeros(0, 3)), ("t", torch.randn(4, 2).t())]
    size = weights.write_shard(tmp_path / "x.safetensors", tensors)
    assert size == sum(t.numel() * t.element_size() for _, t in tensors)
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert sorted(f.keys()) == sorted(n for n, _ in tensors)
        for name, t in tensors:
            assert torch.equal(f.get_tensor(name), t), name

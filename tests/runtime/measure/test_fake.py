"""ppdsl/runtime/measure/fake.py: a causal LM sized from its config.json alone
under fake tensors, checked against real CPU runs and a count by hand
(docs/architecture.md, runtime/measure/)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from ppdsl.runtime.measure.fake import (  # noqa: E402
    DEVICES,
    device_spec,
    fake_layer_bytes,
    model_size,
)
from ppdsl.runtime.models.hf import HFStage, anatomy_of, load_causal_lm  # noqa: E402
from tests.paths import EXAMPLES  # noqa: E402

TINY = EXAMPLES / "models" / "tiny_llama"


def _real_saved_bytes(stage: torch.nn.Module, x: torch.Tensor) -> int:
    """What a real forward's autograd keeps, parameters left out, each storage
    once by its address (the runtime meter's rule, `storage_bytes`)."""
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(x)
    del out
    return sum(seen.values())


def test_fake_activation_bytes_equal_a_real_forward() -> None:
    """One decoder layer's M_B under fake tensors equals what a real CPU
    forward at the same shapes keeps (tiny Llama, hidden 64, sequence 96)."""
    size = model_size(str(TINY), seq_len=96, microbatch_size=3)
    model = load_causal_lm(TINY)
    layer = HFStage(model, anatomy_of(model), range(1), first=False, last=False)
    x = torch.randn(3, 96, 64, requires_grad=True)
    real = _real_saved_bytes(layer, x)
    assert size.layers[1].activation_bytes == real
    assert 0 < size.layers[1].weight_bytes < real


def test_fake_and_real_measure_alike() -> None:
    """`fake_layer_bytes` on real tensors gives the same bytes and FLOPs as
    under fake tensors (the sizing is no artefact of FakeTensorMode)."""
    size = model_size(str(TINY), seq_len=32, microbatch_size=2)
    model = load_causal_lm(TINY)
    layer = HFStage(model, anatomy_of(model), range(1), first=False, last=False)
    real = fake_layer_bytes(layer, torch.randn(2, 32, 64, requires_grad=True))
    fake = size.layers[1]
    assert (real.activation_bytes, real.weight_bytes, real.stash_bytes, real.flops) == (
        fake.activation_bytes, fake.weight_bytes, fake.stash_bytes, fake.flops)


def _hand_count(config: dict) -> tuple[int, int, int]:
    """Embedding, one decoder layer and the head's parameters of a Llama config."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv, d = (config["num_attention_heads"], config["num_key_value_heads"],
                    config.get("head_dim", h // config["num_attention_heads"]))
    attention = h * heads * d * 2 + h * kv * d * 2  # q and o; k and v
    mlp = 3 * h * i  # gate, up, down
    return v * h, attention + mlp + 2 * h, h + v * h  # the layer's two norms; the final norm


@pytest.mark.slow
@pytest.mark.parametrize("folder", ["tiny_llama", "llama3_8b", "llama3_70b"])
def test_parameters_counted_by_hand(folder: str) -> None:
    """Parameter counts from the meta build equal a count by hand from the
    config's numbers (Llama-3-8B: 8.03e9 in all)."""
    path = EXAMPLES / "models" / folder
    config = json.loads((path / "config.json").read_text())
    size = model_size(str(path), seq_len=8, microbatch_size=1, dtype="bf16")
    embedding, layer, head = _hand_count(config)
    assert size.layers[0].parameters == embedding
    assert {x.parameters for x in size.layers[1:-1]} == {layer}
    assert size.layers[-1].parameters == head
    assert size.num_layers == config["num_hidden_layers"]
    if folder == "llama3_8b":
        assert sum(x.parameters for x in size.layers) == 8_030_261_248


def test_flops_split_by_pass_kind() -> None:
    """A decoder layer's W is its linear layers' weight-gradient matmuls
    (2·tokens·in·out each), B the rest of the backward, F the forward."""
    config = json.loads((TINY / "config.json").read_text())
    size = model_size(str(TINY), seq_len=16, microbatch_size=2)
    _, layer, _ = _hand_count(config)
    flops = size.layers[1].flops
    matmul_weights = layer - 2 * config["hidden_size"]
    assert flops["W"] == 2 * 32 * matmul_weights
    assert flops["B"] + flops["W"] == flops["BW"]
    assert flops["F"] >= 2 * 32 * matmul_weights


def test_device_spec_named_and_from_a_file(tmp_path: Path) -> None:
    """`--gpu` takes a named device or a JSON file of the spec's fields; a bad
    one is a ValueError saying what to give."""
    assert device_spec("H100") is DEVICES["h100"]
    spec = tmp_path / "gpu.json"
    spec.write_text(json.dumps({"name": "x", "bf16_tflops": 100, "fp32_tflops": 50,
                                "hbm_gbps": 1000, "link_gbps": 50, "efficiency": 0.4,
                                "memory_bytes": 2**34}))
    assert device_spec(str(spec)).bf16_tflops == 100
    spec.write_text("{}")
    with pytest.raises(ValueError, match="not a device spec"):
        device_spec(str(spec))
    with pytest.raises(ValueError, match="h100, h200, a100"):
        device_spec("tpu")

"""tiny_gpt with dropout whose batch() appends "ATTEMPT STEP" to
$PPDSL_TEST_BATCH_LOG.RANK each time it is called: which steps' data each
torchrun attempt trained on."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

from ppdsl.runtime import PipelineModel

_TINY = Path(__file__).resolve().parents[2] / "examples" / "models" / "tiny_gpt.py"


def logged(num_stages: int) -> PipelineModel:
    spec = importlib.util.spec_from_file_location("tiny_gpt_for_restarts", _TINY)
    assert spec is not None and spec.loader is not None
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    model = tiny.stages_dropout(num_stages)
    log = os.environ["PPDSL_TEST_BATCH_LOG"] + "." + os.environ.get("RANK", "?")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    def batch(step: int, batch_size: int):
        with open(log, "a") as f:
            f.write(f"{attempt} {step}\n")
        return model.batch(step, batch_size)

    return dataclasses.replace(model, batch=batch)


def wedged(num_stages: int) -> PipelineModel:
    """tiny_gpt whose last stage's forward blocks for an hour at its fifth call
    (step 2 with 4 microbatches): a live rank that stops answering, its
    heartbeat still beating."""
    import time

    from torch import nn

    spec = importlib.util.spec_from_file_location("tiny_gpt_for_hangs", _TINY)
    assert spec is not None and spec.loader is not None
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    model = tiny.stages(num_stages)
    calls = [0]

    class Wedge(nn.Module):
        def forward(self, x):
            calls[0] += 1
            if calls[0] == 5:
                time.sleep(3600)
            return x

    def stage(index: int) -> nn.Module:
        built = model.stage(index)
        return nn.Sequential(Wedge(), built) if index == num_stages - 1 else built

    return dataclasses.replace(model, stage=stage)

"""ppdsl/commands/run.py: the programs `ppdsl run` hands its ranks are proven
under the transport they run on (docs/runtime.md, "Communication")."""

from __future__ import annotations

import argparse

from ppdsl.commands.common import compile_from_args
from ppdsl.commands.run import programs_for_transport
from ppdsl.ir.rank import format_rank_programs
from tests.paths import EXAMPLES


def _args(device: str, share_gpu: bool = False) -> argparse.Namespace:
    return argparse.Namespace(file=str(EXAMPLES / "zb_v.pp"), defines=["d=4", "m=8"],
                              device=device, share_gpu=share_gpu, costs_from=None)


def test_ranks_on_their_own_gpus_get_the_nccl_programs():
    """On CUDA (NCCL between ranks) ZB-V's programs are recompiled with receives
    in their peers' send order, as `--comm-model nccl` compiles them; on CPU and
    on a shared GPU (gloo, matched by tag) the programs stay as compiled."""
    plain = compile_from_args(_args("cpu"))
    nccl = compile_from_args(argparse.Namespace(**vars(_args("cuda")), comm_model="nccl"))
    text = format_rank_programs(plain.lowered)
    assert format_rank_programs(nccl.lowered) != text  # ZB-V's V crosses two receives
    on_gpu = programs_for_transport(plain, _args("cuda"))
    assert format_rank_programs(on_gpu.lowered) == format_rank_programs(nccl.lowered)
    for args in (_args("cpu"), _args("cuda", share_gpu=True)):
        assert programs_for_transport(plain, args) is plain

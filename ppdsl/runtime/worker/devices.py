"""Which device a rank trains on.

One GPU cannot host two ranks (NCCL refuses two ranks on one device, and gloo
cannot move CUDA tensors), so CUDA is used only when the node has a GPU for every
local rank: `--device auto` falls back to CPU with a one-line note otherwise, and
`--device cuda` with too few GPUs is a usage error before anything starts.
`--share-gpu` asks for the development mode instead: the ranks share the GPUs
(rank r on GPU r mod count, time-sliced), in a gloo group, their transfers
staged through pinned host memory (`ppdsl.runtime.execution.transport`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DeviceChoice", "choose_device"]


@dataclass(frozen=True)
class DeviceChoice:
    """The outcome of `choose_device`."""

    kind: str | None
    """"cuda" or "cpu"; None when the request cannot be met (see `error`)."""
    note: str | None = None
    """A line to print once (why auto chose CPU), or None."""
    error: str | None = None
    """Why the request cannot be met (exit 2), or None."""


def choose_device(requested: str, local_ranks: int, share_gpu: bool = False) -> DeviceChoice:
    """`requested` is auto, cpu or cuda; `local_ranks` the processes on this node
    (torchrun's LOCAL_WORLD_SIZE); `share_gpu`: ranks may share a GPU."""
    if requested == "cpu":
        return DeviceChoice("cpu")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if share_gpu and 0 < gpus < local_ranks:
        return DeviceChoice("cuda", note=(
            f"ppdsl: note: development mode (--share-gpu): {local_ranks} ranks share "
            f"{gpus} GPU{'s' if gpus != 1 else ''} and time-slice it; transfers are staged "
            "through pinned host memory over gloo, so timings are not a real pipeline's"
        ))
    if requested == "cuda":
        if gpus >= local_ranks:
            return DeviceChoice("cuda")
        have = "no GPU" if gpus == 0 else f"{gpus} GPU{'s' if gpus != 1 else ''}"
        return DeviceChoice(None, error=(
            f"--device cuda needs one GPU per rank on this node ({local_ranks} local "
            f"rank{'s' if local_ranks != 1 else ''}), but there {'is' if gpus == 1 else 'are'} "
            f"{have}; run fewer ranks per node or use --device cpu"
        ))
    if gpus >= local_ranks:
        return DeviceChoice("cuda")
    if gpus == 0:
        return DeviceChoice("cpu")
    return DeviceChoice("cpu", note=(
        f"ppdsl: note: {gpus} GPU{'s' if gpus != 1 else ''} for {local_ranks} local ranks "
        "(one GPU cannot host two ranks): training on CPU with gloo"
    ))

"""The runtime that generated rank programs call: transfers, the B/W split,
memory measurement, start-up checks (docs/runtime.md)."""

from ppdsl.runtime.model import PipelineModel, split_layers

__all__ = ["PipelineModel", "split_layers"]

"""ppdsl: a compiler for pipeline-parallel training schedules."""

__version__ = "0.1.0"

__all__ = ["__version__"]

"""Which of torchrun's attempts this process is, and the rendezvous store of
that attempt.

torchrun (`--max-restarts N`) restarts every worker after a failure and says
which attempt this is in `TORCHELASTIC_RESTART_COUNT`. Its store (the agent's,
at MASTER_ADDR:MASTER_PORT) outlives the workers, and with the static
rendezvous (`--master-addr/--master-port`) torch's `env://` keys are the same in
every attempt: a restarted gloo group reads the dead workers' addresses and
fails to connect ("Gloo connectFullMesh failed ... Connection refused"). So
ppdsl forms its process group on a store whose keys carry the attempt, and so
does its watchdog.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

__all__ = ["restart_count", "max_restarts", "attempt_store", "attempt_prefix", "attempt_note"]


def restart_count() -> int:
    """0 on torchrun's first attempt, then 1, 2, ... after each restart."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def max_restarts() -> int:
    """How many times torchrun may restart the workers (its `--max-restarts`)."""
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)


def attempt_prefix() -> str:
    """The prefix of this attempt's keys in the rendezvous store."""
    return f"ppdsl/attempt{restart_count()}/"


def attempt_store(rank: int, world_size: int, timeout: float) -> dist.Store:
    """A client of the rendezvous store at MASTER_ADDR:MASTER_PORT (hosted by
    torchrun's agent, or by rank 0 when the launcher says it does not host
    one), its keys prefixed by this attempt."""
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500")),
        world_size, is_master=rank == 0 and not agent_hosts,
        timeout=timedelta(seconds=timeout),
    )
    return dist.PrefixStore(attempt_prefix(), store)


def attempt_note() -> str:
    """A phrase for the start-up line when torchrun may restart the workers."""
    if max_restarts() == 0:
        return ""
    if restart_count():
        return f" (restart {restart_count()} of at most {max_restarts()})"
    return f" (torchrun may restart the workers {max_restarts()} times)"

"""The torchrun process around a rank (docs/architecture.md, "The runtime"): which
attempt this is after a restart, the fault points tests kill a rank at, where the
rank is in its step, the watchdog that stops every rank when one dies, the device
it runs on, the CPU allocator's setting, and the bootstrap that runs a body (the
training loop) inside all of them. Nothing here knows what a schedule is.

The face: `run_worker`, `Worker`, `choose_device`, `Watchdog`, `attempt_note`,
`attempt_store`; the modules `faults` and `progress` are used by name
(`faults.reached(...)`)."""

from __future__ import annotations

from ppdsl.runtime._lazy import lazy_getattr

__all__ = ["run_worker", "Worker", "world_from_env", "choose_device", "DeviceChoice", "Watchdog",
           "attempt_note", "attempt_store", "keep_freed_memory"]

__getattr__ = lazy_getattr(__name__, {
    "run_worker": "bootstrap",
    "Worker": "bootstrap",
    "world_from_env": "bootstrap",
    "choose_device": "devices",
    "DeviceChoice": "devices",
    "Watchdog": "watchdog",
    "attempt_note": "attempt",
    "attempt_store": "attempt",
    "keep_freed_memory": "cpu",
})

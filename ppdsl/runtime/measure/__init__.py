"""Measurement for the compiler (docs/runtime.md, "ppdsl profile"): per-stage pass
costs and memory, transfers, collectives and the engine's overhead, written as a
costs file; the per-layer profile of a `hf:DIR` model and the cut it chooses.

One module per job: `records` (what was measured, its JSON and table),
`stages` (one stage's passes timed and measured; a chain of stages), `transfers`
(transfers and collectives measured alone), `gloo_worker` (the programs run in
several gloo processes), `launch` (their launcher), `engine_profile` (the passes through
the runtime's engine, the step besides passes), `profile` (`ppdsl profile`'s
driver), `costs_pp` (the costs file), `cut` (the per-layer profile and the cut) and
`hostops` (the host's work per pass, counted).
"""

from __future__ import annotations

from ppdsl.runtime._lazy import lazy_getattr

__all__ = ["profile_model", "prepare_device", "to_costs_pp", "profile_layers", "balanced_cut",
           "choose_cut", "stage_profile", "describe"]

__getattr__ = lazy_getattr(__name__, {
    "profile_model": "profile",
    "prepare_device": "stages",
    "to_costs_pp": "costs_pp",
    "profile_layers": "cut",
    "balanced_cut": "cut",
    "choose_cut": "cut",
    "stage_profile": "cut",
    "describe": "cut",
})

"""Small profiles with round numbers, for the tests of ppdsl/runtime/measure/."""

from __future__ import annotations

from ppdsl.runtime.measure.records import Profile, StageProfile, StageTiming


def small_profile(stages: int = 2) -> Profile:
    """`stages` equal stages (T_F 1.25, T_I 2.5, T_W 1.125, T_B 3.5 ms; M_B 1000 and
    M_W 500 bytes), 400 bytes sent on in 0.5 ms, no step costs."""
    timing = StageTiming(1.25, 2.5, 1.125, 1.2, 3.5, 1000, 1000, 500, 800)
    return Profile(
        "m.py:f", stages, 2, "cpu", 1, 1, 3, "test",
        tuple(StageProfile(s, timing, 400 if s < stages - 1 else 0, 0.5 if s < stages - 1 else None, ())
              for s in range(stages)),
    )

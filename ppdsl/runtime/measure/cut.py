"""Where to cut a transformers causal LM (`--cut balanced`, `ppdsl profile
--per-layer`, `ppdsl plan`): each layer measured alone, stages as sums of their
layers, the balanced cut chosen from those sums.

The layers of the profile are the model's own: the embedding (first stage), each
decoder layer, and the head (final norm, LM head and the loss; last stage). Each
is measured by `ppdsl.runtime.measure.stages.measure_chain` on one microbatch (T_F, T_B
fused, T_I and T_W of the B/W split, M_B and M_W by the runtime's meter) with the
previous layer's output as its input. A stage's costs are the sums of its
layers' (what a stage adds, its own mask and rotary embedding, is left out).

The balanced cut minimises the slowest stage's T_F + T_I + T_W over contiguous
cuts, each stage at least one decoder layer; `max_stage_bytes` bounds each
stage's M_B (the memory budget, turned by `ppdsl plan` into a per-stage bound
for a schedule), ties going to the cut whose stages' times are most even.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from ppdsl.runtime.measure.records import Profile, StageProfile, StageTiming
from ppdsl.runtime.measure.stages import measure_chain, stage_stopwatch
from ppdsl.runtime.measure.transfers import measure_transfer
from ppdsl.runtime.models.hf import HFPipelineModel, HFStage, anatomy_of, parse_cut
from ppdsl.runtime.models.model import ModelError

__all__ = ["LayerProfile", "profile_layers", "stage_timings", "balanced_cut", "stage_profile",
           "choose_cut", "describe", "profile_folder", "boundary_transfer_ms"]


@dataclass(frozen=True)
class LayerProfile:
    """Every layer of a causal LM measured alone (embedding, decoder layers, head)."""

    names: tuple[str, ...]
    """`embedding`, `layer 0` ... `layer n-1`, `head`."""
    timings: tuple[StageTiming, ...]
    """Each layer's measurements, in model order."""
    boundary_bytes: int
    """Bytes of the hidden state a stage sends on (one microbatch)."""
    microbatch_size: int
    """Samples per measured microbatch."""
    clock: str
    """`thread` (CPU time of this thread), `wall`, or `cuda-events` (`Stopwatch.clock`)."""
    warmup: int = 0
    """Untimed runs of each layer before the timed ones."""
    repeats: int = 1
    """Timed runs of each layer (the times are their median)."""

    @property
    def num_layers(self) -> int:
        """Decoder layers (the embedding and head not counted)."""
        return len(self.names) - 2

    def time_ms(self, index: int) -> float:
        """T_F + T_I + T_W of layer `index` of `names`."""
        t = self.timings[index]
        return t.forward_ms + t.input_ms + t.weight_ms

    def to_json(self, cut: Sequence[int] | None = None) -> dict[str, Any]:
        """The layers' measurements (and, given a cut, its stages')."""
        out: dict[str, Any] = {
            "microbatch_size": self.microbatch_size, "clock": self.clock,
            "boundary_bytes": self.boundary_bytes,
            "layers": [{"layer": n, **asdict(t)} for n, t in zip(self.names, self.timings,
                                                                 strict=True)],
        }
        if cut is not None:
            out["cut"] = list(cut)
            out["stages"] = [{"stage": s, **asdict(t)}
                             for s, t in enumerate(stage_timings(self, cut))]
        return out

    def stage_table(self, cut: Sequence[int]) -> str:
        """One row per stage of `cut`: its summed costs."""
        lines = [f"{'stage':<10} {'T_F':>8} {'T_B':>8} {'T_I':>8} {'T_W':>8} {'M_B':>11} "
                 f"{'M_W':>11} {'F+I+W':>8}"]
        for s, t in enumerate(stage_timings(self, cut)):
            lines.append(
                f"{s:<10} {t.forward_ms:8.3f} {t.fused_ms:8.3f} {t.input_ms:8.3f} "
                f"{t.weight_ms:8.3f} {t.activation_bytes:11d} {t.weight_bytes:11d} "
                f"{t.forward_ms + t.input_ms + t.weight_ms:8.3f}")
        return "\n".join(lines) + "\n"

    def table(self) -> str:
        """One row per layer: times in ms, memory in bytes, and its share of the whole."""
        total = sum(self.time_ms(i) for i in range(len(self.names))) or 1.0
        lines = [f"{'layer':<10} {'T_F':>8} {'T_B':>8} {'T_I':>8} {'T_W':>8} {'M_B':>11} "
                 f"{'M_W':>11} {'share':>6}"]
        for i, (name, t) in enumerate(zip(self.names, self.timings, strict=True)):
            lines.append(
                f"{name:<10} {t.forward_ms:8.3f} {t.fused_ms:8.3f} {t.input_ms:8.3f} "
                f"{t.weight_ms:8.3f} {t.activation_bytes:11d} {t.weight_bytes:11d} "
                f"{self.time_ms(i) / total:6.1%}")
        lines.append(f"(ms of {'this thread' if self.clock == 'thread' else 'wall'} time, median; "
                     f"microbatch {self.microbatch_size}; T_B is the fused backward)")
        return "\n".join(lines) + "\n"


def profile_layers(
    model: HFPipelineModel,
    microbatch_size: int,
    device: torch.device,
    *,
    warmup: int = 3,
    repeats: int = 10,
    progress: Callable[[str, float], None] | None = None,
) -> LayerProfile:
    """Measure each layer of `model` (a `ppdsl.runtime.models.hf.pipeline_model`) on a
    microbatch of its first batch."""
    whole = model.whole()
    anatomy = anatomy_of(whole)
    num_layers = len(whole.get_submodule(anatomy.layers))
    watch = stage_stopwatch(device)
    inputs, targets = model.batch(0, microbatch_size)
    inputs, targets = inputs.to(device), targets.to(device)
    units: list[tuple[str, HFStage]] = [("embedding", HFStage(whole, anatomy, range(0), True, False))]
    units += [(f"layer {i}", HFStage(whole, anatomy, range(i, i + 1), False, False))
              for i in range(num_layers)]
    units.append(("head", HFStage(whole, anatomy, range(0), False, True)))

    def loss(y: torch.Tensor) -> torch.Tensor:
        return model.loss(y, targets)

    links = list(measure_chain(units, len(units), inputs, loss, device,
                               where=f"the per-layer profile of {type(whole).__name__}",
                               warmup=warmup, repeats=repeats, clock=watch.host_clock,
                               progress=progress))
    return LayerProfile(tuple(link.name for link in links), tuple(link.timing for link in links),
                        links[-2].boundary_bytes, microbatch_size, watch.clock, warmup, repeats)


def _sum(timings: Sequence[StageTiming]) -> StageTiming:
    return StageTiming(**{f.name: sum(getattr(t, f.name) for t in timings)
                          for f in fields(StageTiming)})


def stage_timings(profile: LayerProfile, cut: Sequence[int]) -> list[StageTiming]:
    """Each stage's costs under `cut` (each stage's first decoder layer): the
    sums of its layers', the embedding's on the first stage, the head's on the
    last."""
    n = profile.num_layers
    ends = list(cut[1:]) + [n]
    stages = []
    for s, (a, b) in enumerate(zip(cut, ends, strict=True)):
        parts = [profile.timings[1 + i] for i in range(a, b)]
        if s == 0:
            parts.insert(0, profile.timings[0])
        if s == len(cut) - 1:
            parts.append(profile.timings[-1])
        stages.append(_sum(parts))
    return stages


def balanced_cut(profile: LayerProfile, num_stages: int,
                 max_stage_bytes: Sequence[float] | None = None) -> tuple[int, ...]:
    """The cut minimising the slowest stage's T_F + T_I + T_W (then the sum of
    squared stage times, for evenness), each stage at least one decoder layer and,
    with `max_stage_bytes`, stage s holding at most `max_stage_bytes[s]` of M_B;
    `ModelError` when no cut fits."""
    n = profile.num_layers
    if n < num_stages:
        raise ModelError(f"the model has {n} decoder layers, fewer than the {num_stages} stages")
    time_of = [profile.time_ms(1 + i) for i in range(n)]
    bytes_of = [profile.timings[1 + i].activation_bytes for i in range(n)]
    head_t, tail_t = profile.time_ms(0), profile.time_ms(len(profile.names) - 1)
    head_b = profile.timings[0].activation_bytes
    tail_b = profile.timings[-1].activation_bytes
    prefix_t, prefix_b = [0.0], [0]
    for t, b in zip(time_of, bytes_of, strict=True):
        prefix_t.append(prefix_t[-1] + t)
        prefix_b.append(prefix_b[-1] + b)

    def stage(s: int, a: int, b: int) -> tuple[float, float]:
        t = prefix_t[b] - prefix_t[a]
        m = float(prefix_b[b] - prefix_b[a])
        if s == 0:
            t, m = t + head_t, m + head_b
        if s == num_stages - 1:
            t, m = t + tail_t, m + tail_b
        return t, m

    inf = (float("inf"), float("inf"))
    # best[s][b]: (slowest, sum of squares) of stages 0..s covering layers [0, b)
    best: list[list[tuple[float, float]]] = [[inf] * (n + 1) for _ in range(num_stages)]
    start: list[list[int]] = [[-1] * (n + 1) for _ in range(num_stages)]
    for s in range(num_stages):
        for b in range(s + 1, n - (num_stages - 1 - s) + 1):
            for a in range(s, b):
                if s == 0 and a:
                    break
                before = (0.0, 0.0) if s == 0 else best[s - 1][a]
                if before == inf:
                    continue
                t, m = stage(s, a, b)
                if max_stage_bytes is not None and m > max_stage_bytes[s]:
                    continue
                value = (max(before[0], t), before[1] + t * t)
                if value < best[s][b]:
                    best[s][b], start[s][b] = value, a
    if best[num_stages - 1][n] == inf:
        raise ModelError("no cut into contiguous stages keeps every stage within the memory bound")
    cut, b = [], n
    for s in range(num_stages - 1, -1, -1):
        a = start[s][b]
        cut.append(a)
        b = a
    return tuple(reversed(cut))


def stage_profile(profile: LayerProfile, cut: Sequence[int], model: str,
                  transfer_ms: float | None = None, device: str = "cpu") -> Profile:
    """The per-stage `Profile` that `cut` makes of the layer profile (what
    `ppdsl.runtime.measure.costs_pp.to_costs_pp` writes as a costs file)."""
    timings = stage_timings(profile, cut)
    last = len(cut) - 1
    stages = tuple(
        StageProfile(s, t, 0 if s == last else profile.boundary_bytes,
                     None if s == last else transfer_ms, ())
        for s, t in enumerate(timings))
    threads = torch.get_num_threads()
    return Profile(model=model, num_stages=len(cut), microbatch_size=profile.microbatch_size,
                   device=device, threads=threads, warmup=profile.warmup,
                   repeats=profile.repeats,
                   transfer_method="measured" if transfer_ms is not None else "not measured",
                   stages=stages, clock=profile.clock)


def profile_folder(
    directory: str, seq_len: int, microbatch_size: int, *, seed: int = 0, warmup: int = 3,
    repeats: int = 10, progress: Callable[[str, float], None] | None = None,
) -> LayerProfile:
    """`profile_layers` of the model in `directory` on CPU with one torch thread,
    as a rank of `ppdsl run` computes (the caller's thread count restored)."""
    from ppdsl.runtime.models.hf import HFOptions, pipeline_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = pipeline_model(directory, 1, HFOptions(seq_len=seq_len, seed=seed))
        return profile_layers(model, microbatch_size, torch.device("cpu"), warmup=warmup,
                              repeats=repeats, progress=progress)
    finally:
        torch.set_num_threads(threads)


def boundary_transfer_ms(profile: LayerProfile) -> float | None:
    """The time to move one microbatch's hidden state to another rank (gloo on
    loopback, `ppdsl.runtime.measure.transfers.measure_transfer`)."""
    measured, _ = measure_transfer([profile.boundary_bytes], torch.device("cpu"))
    return measured[0] if measured else None


def choose_cut(profile: LayerProfile, num_stages: int, cut: str) -> tuple[int, ...]:
    """`--cut`: `balanced` from the profile, else `equal` or a list (checked)."""
    if cut == "balanced":
        return balanced_cut(profile, num_stages)
    return parse_cut(cut, profile.num_layers, num_stages)


def describe(cut: Sequence[int], num_layers: int) -> str:
    """`0,2,3 (layers 0-1 | 2 | 3)`: a cut as the messages print it."""
    ends = list(cut[1:]) + [num_layers]
    spans = [f"{a}" if b - a == 1 else f"{a}-{b - 1}" for a, b in zip(cut, ends, strict=True)]
    return ",".join(map(str, cut)) + " (layers " + " | ".join(spans) + ")"

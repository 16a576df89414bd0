"""What a search is asked: devices, microbatches, placement, costs, the memory
model and the memory budget, and how the command line spells them.

Memory units. Budgets are in multiples of M_B, the activation one microbatch
leaves on one *1F1B stage* (1/d of the model). A placement with v chunks per
device cuts the model into v·d stages, so one of its stages leaves M_B / v: the
emitted `.pp` says `memory M_B = 1/2` for a V-shape. 1F1B holds d·M_B on its
first device; `0.5x1f1b` is therefore d/2 · M_B on every placement, and budgets
compare bytes across placements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction

from ppdsl import semantics
from ppdsl.ir.schedule import Costs, MemoryModel, Placement
from ppdsl.semantics import PassKind, format_number
from ppdsl.topology import Topology

__all__ = [
    "SearchProblem",
    "SearchInputError",
    "parse_budget",
    "parse_costs",
    "one_f_one_b_memory",
    "build_problem",
    "smallest_budget",
    "measured_memory",
    "measured_unit",
    "chunk_costs",
    "with_recompute",
    "with_topology",
    "recompute_headroom",
]


class SearchInputError(ValueError):
    """Bad search input (the command prints it and exits 1)."""


@dataclass(frozen=True)
class SearchProblem:
    """One search: find per-device orders with the smallest bubble ratio whose
    peak activation memory stays within `budget` on every device."""

    num_devices: int
    """d: pipeline ranks."""
    num_microbatches: int
    """m: microbatches per training step."""
    placement: Placement
    """Which device holds each stage."""
    costs: Costs
    """Pass durations per stage and the cross-device transfer cost."""
    memory: MemoryModel
    """M_B and M_W per stage, in 1F1B-stage units (a chunk's M_B is 1/v)."""
    budget: Fraction
    """Peak activation memory allowed on every device, same units."""
    weight_fraction: Fraction = semantics.DEFAULT_WEIGHT_FRACTION
    """M_W / M_B (1/2 is ppdsl's default; 1 counts a microbatch as held until
    its W ends, as the controllable-memory paper does)."""

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages

    @property
    def chunks_per_device(self) -> int:
        return self.placement.num_stages // self.placement.num_devices

    @property
    def model_chunks_per_device(self) -> int:
        """v such that one of its stages is 1/v of a 1F1B stage: the chunks per
        device, but 1 on DualPipe (its stages are whole copies of the model's d
        stages, two lanes on every device)."""
        return self.placement.num_model_stages // self.placement.num_devices


_PLACEMENTS = ("parallel", "vshape", "looped", "dualpipe")
"""The placements the search knows blocks and heuristics for."""


def _named(kind: str, num_devices: int, v: int | None = None) -> Placement:
    if kind not in _PLACEMENTS:
        raise SearchInputError(
            f"unknown placement {kind!r}: use parallel, vshape, looped(v) or dualpipe"
        )
    return Placement.named(kind, num_devices, v)


def parse_placement(text: str, num_devices: int) -> Placement:
    """`parallel`, `vshape`, `looped(3)`, `looped3` or `dualpipe`."""
    words = text.strip().lower()
    try:
        name, v = semantics.read_placement(words)
    except ValueError:
        name, v = words, None
    if name != "looped" and v is not None:
        name = words  # an unknown placement, named as written
    if name == "looped":
        if v is None:
            raise SearchInputError("looped needs its chunk count: --placement 'looped(2)'")
        if v < 1:
            raise SearchInputError(f"looped({v}): v must be at least 1")
        return _named("looped", num_devices, v)
    return _named(name, num_devices)


_COST_KEYS = {
    "F": "forward", "B": "backward_input", "W": "backward_weight", "comm": "comm",
    "reduce": "reduce", "bytes": "bytes", "grad_bytes": "grad_bytes",
}
_SIZES = ("bytes", "grad_bytes")
"""`--costs` keys that are sizes in bytes per stage (`memory bytes[s]`, `memory grad_bytes[s]`)."""


def parse_costs(text: str | None, num_stages: int) -> Costs:
    """`F=18.5,B=18.1,W=9.3,comm=0.6`; a per-stage cost is a colon list with one
    value per stage (`F=1:1:2:2`). Unnamed kinds and comm cost their defaults
    (`semantics.DEFAULT_DURATION`: 1; comm 0). `reduce=` is a stage's
    data-parallel gradient reduction (`cost reduce[s]`, 0 unless given);
    `bytes=` and `grad_bytes=` the sizes a stage sends on and reduces (`memory
    bytes[s]`, `memory grad_bytes[s]`), what a `--topology` times over its links."""
    values: dict[str, tuple[float, ...] | float] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in _COST_KEYS:
            raise SearchInputError(
                f"--costs {item.strip()!r}: expected F=, B=, W=, comm=, reduce=, bytes= or "
                "grad_bytes= "
                "(e.g. F=3,B=4,W=2,comm=0)"
            )
        try:
            numbers = tuple(float(Fraction(x.strip())) for x in value.split(":"))
        except (ValueError, ZeroDivisionError):
            raise SearchInputError(f"--costs {item.strip()!r}: {value!r} is not a number") from None
        if any(x < 0 or not math.isfinite(x) for x in numbers):
            raise SearchInputError(f"--costs {item.strip()!r}: costs must be finite and >= 0")
        if key == "comm":
            if len(numbers) != 1:
                raise SearchInputError("--costs comm= takes one value")
            values[key] = numbers[0]
            continue
        if len(numbers) == 1:
            numbers = numbers * num_stages
        if len(numbers) != num_stages:
            raise SearchInputError(
                f"--costs {key}= lists {len(numbers)} values; this placement has "
                f"{num_stages} stages"
            )
        if key != "reduce" and key not in _SIZES and any(x <= 0 for x in numbers):
            raise SearchInputError(f"--costs {key}=: a pass must take some time (> 0)")
        values[key] = numbers
    comm = values.pop("comm", float(semantics.DEFAULT_COMM))
    assert isinstance(comm, float)
    reduce = values.pop("reduce", None)
    sizes = [values.pop(k, ()) for k in _SIZES]
    given = {PassKind(k): v for k, v in values.items() if isinstance(v, tuple)}
    costs = Costs.by_kind(given, comm, num_stages)
    if any(sizes):
        costs = costs.with_bytes(0.0, *sizes)  # type: ignore[arg-type]
    return costs.with_collectives({"reduce": reduce}) if isinstance(reduce, tuple) else costs


def one_f_one_b_memory(num_devices: int) -> Fraction:
    """1F1B's peak on its first device: d·M_B (M_B of a 1F1B stage)."""
    return Fraction(num_devices)


def parse_budget(text: str, num_devices: int) -> Fraction:
    """`8`, `1.5p`, `2p`, `3/2p` (p = d devices), or `0.5x1f1b` (relative to
    1F1B's d·M_B). Returns the budget in M_B."""
    raw = text.strip().lower().replace(" ", "")
    try:
        if raw.endswith("x1f1b"):
            return Fraction(raw[: -len("x1f1b")] or "1") * one_f_one_b_memory(num_devices)
        if raw.endswith("p"):
            return Fraction(raw[:-1] or "1") * num_devices
        if raw.endswith("m_b"):
            raw = raw[:-3].rstrip("*")
        return Fraction(raw)
    except (ValueError, ZeroDivisionError):
        raise SearchInputError(
            f"--memory {text!r}: expected a multiple of M_B such as 8, 2p, 1.5p or 0.5x1f1b"
        ) from None


def make_memory(placement: Placement, weight_fraction: Fraction) -> MemoryModel:
    """M_B = 1/v of a 1F1B stage per stage, v the model's stages per device (a
    DualPipe stage is a whole model stage: 1); M_W = weight_fraction · M_B."""
    v = placement.num_model_stages // placement.num_devices
    activation = (Fraction(1, v),) * placement.num_stages
    return MemoryModel(activation, tuple(a * weight_fraction for a in activation))


def smallest_budget(placement: Placement, memory: MemoryModel) -> Fraction:
    """The least budget any schedule needs: one microbatch in flight, i.e. the
    activations of every chunk of the fullest device at once (a microbatch
    keeps its earlier chunks' activations until their B); with several lanes
    (DualPipe) the chunks of the fullest lane, a microbatch's only ones."""
    return max(
        sum(
            (memory.activation[s] for s in placement.chunks(dev)
             if placement.lane_of_stage(s) == lane),
            Fraction(0),
        )
        for dev in range(placement.num_devices)
        for lane in range(placement.lanes)
    )


def build_problem(
    *,
    devices: int,
    microbatches: int,
    placement: str,
    costs: str | None,
    memory: str | None,
    weight_fraction: str = "1/2",
    measured: tuple[Costs, MemoryModel] | None = None,
) -> SearchProblem:
    """A SearchProblem from the command line's spelling; every inconsistency is
    a SearchInputError that says what to do. `measured` (`--costs-from`) gives
    the costs and the per-stage memory model instead of `costs` and
    `weight_fraction`; its memory is rescaled to 1F1B-stage units (the model's
    whole activation is d of them), see `measured_memory`. `memory` None: the
    smallest feasible budget (a frontier sets its own)."""
    if devices < 1:
        raise SearchInputError(f"--devices {devices}: need at least 1 device")
    if microbatches < 1:
        raise SearchInputError(f"--microbatches {microbatches}: need at least 1 microbatch")
    pl = parse_placement(placement, devices)
    try:
        wf = Fraction(weight_fraction)
    except (ValueError, ZeroDivisionError):
        raise SearchInputError(f"--weight-memory {weight_fraction!r} is not a number") from None
    if not 0 <= wf <= 1:
        raise SearchInputError(
            f"--weight-memory {weight_fraction}: M_W is part of M_B, so between 0 and 1"
        )
    mm = make_memory(pl, wf)
    pass_costs = parse_costs(costs, pl.num_stages)
    if measured is not None:
        # the unit is one 1F1B stage: the model's d stages (DualPipe: twice over)
        pass_costs, mm = measured[0], measured_memory(measured[1], devices * pl.lanes)
        if len(mm.activation) != pl.num_stages:
            raise SearchInputError(
                f"the measured costs are for {len(mm.activation)} stages; --placement "
                f"{placement} with {devices} devices has {pl.num_stages}"
            )
    floor = smallest_budget(pl, mm)
    if memory is None:
        return SearchProblem(devices, microbatches, pl, pass_costs, mm, floor, wf)
    budget = parse_budget(memory, devices)
    if budget < floor:
        raise SearchInputError(
            f"--memory {memory} is {format_number(budget)} M_B per device, below the smallest feasible "
            f"budget {format_number(floor)} M_B (one microbatch in flight); use --memory {format_number(floor)} "
            "or more"
        )
    return SearchProblem(devices, microbatches, pl, pass_costs, mm, budget, wf)


def measured_unit(memory: MemoryModel, num_devices: int) -> Fraction:
    """One 1F1B stage's activation in `memory`'s units: the model's whole
    activation (the sum of its stages' M_B) over d."""
    total = sum(memory.activation, Fraction(0))
    return total / num_devices if total > 0 else Fraction(1)


def measured_memory(memory: MemoryModel, num_devices: int) -> MemoryModel:
    """`memory` (e.g. a profile's, in its own units) in 1F1B-stage units (exact:
    every value shares the denominator of the sum)."""
    unit = measured_unit(memory, num_devices)

    def scale(x: Fraction) -> Fraction:
        return x / unit

    return MemoryModel(
        tuple(scale(a) for a in memory.activation), tuple(scale(w) for w in memory.weight_retained)
    )




def chunk_costs(costs: Costs, chunks_per_device: int) -> Costs:
    """`costs` of one 1F1B stage (1/d of the model) as those of one chunk of a
    placement with `chunks_per_device` chunks per device: every pass and a
    stage's gradient reduction take 1/v of their time (and it reduces 1/v of the
    gradient bytes); a transfer costs the same (a frontier compares placements so)."""
    if chunks_per_device == 1:
        return costs
    v = chunks_per_device
    return replace(
        costs,
        durations=tuple(tuple(x / v for x in row) for row in costs.durations),
        collectives=tuple(tuple(x / v for x in row) for row in costs.collectives),
        grad_bytes=tuple(x / v for x in costs.grad_bytes),
    )


def with_topology(problem: SearchProblem, topology: Topology | None, dp: int = 1) -> SearchProblem:
    """`problem` with its transfers (and, with `dp` > 1 and gradient bytes, its
    reductions) timed over `topology`'s links (`ppdsl.topology`); itself without one."""
    if topology is None:
        return problem
    why = topology.check_fits(problem.num_devices, dp)
    if why:
        raise SearchInputError(f"--topology: {why}")
    return replace(problem, costs=topology.apply(problem.costs, problem.placement, dp))


def with_recompute(problem: SearchProblem, stages: frozenset[int], kept: Fraction) -> SearchProblem:
    """`problem` with `stages` recomputed (docs/language.md, `recompute`): their F
    keeps `kept` · M_B (the input, M_I) and an R (costing T_F, the language's
    default `cost R`) restores the rest before the backward."""
    mm = problem.memory
    kept_input = tuple(
        kept * mm.activation[s] if s in stages else None for s in range(problem.num_stages)
    )
    memory = MemoryModel(mm.activation, mm.weight_retained, kept_input if stages else ())
    return replace(problem, memory=memory)


def recompute_headroom(memory: MemoryModel) -> Fraction:
    """What a recomputed stage's R holds above its B's net change: the search
    times R and B as one pass (R right before B, as Megatron recomputes), whose
    net delta is M_W − M_I, while the level between them is M_B − M_I above the
    level before; so the real peak is at most the fused one plus the largest
    M_B − M_W of a recomputed stage."""
    return max(
        (memory.activation[s] - memory.weight_retained[s] for s in memory.recompute),
        default=Fraction(0),
    )

"""A cluster's links (issue 37, "Time per edge"): nodes of GPUs, one link inside
a node (NVLink) and one across nodes (InfiniBand), each with a latency per
message and a bandwidth, and what they make of a schedule's transfers and
data-parallel reductions.

A topology file is `key = value` lines (`#` starts a comment):

    # 2 nodes of 8 GPUs: NVLink inside a node, InfiniBand across
    nodes = 2
    gpus_per_node = 8
    time_unit = ms              # the unit of the schedule's costs (s, ms or us; default ms)
    intra_latency = 3us
    intra_bandwidth = 150GB/s
    inter_latency = 12us
    inter_bandwidth = 25GB/s

A latency is a number in `time_unit`, or one with `s`, `ms`, `us` or `ns`; a
bandwidth is bytes per `time_unit`, or a number with `B/s`, `KB/s`, `MB/s`,
`GB/s`, `KiB/s`, `MiB/s` or `GiB/s`. `--topology` takes a file, or the same
pairs on the command line separated by commas
(`nodes=2,gpus_per_node=8,...`). A bad line is a located error
(`FILE:line:col: error: ...`).

Ranks sit on GPUs in order, as torchrun numbers them: pipeline rank r of
data-parallel replica k is world rank k * d + r (`runtime.execution.group.placement_of`),
on node (k * d + r) // gpus_per_node. `apply` times, for one placement and
`dp` replicas:

- each edge (a transfer between stages b and b + 1, either way): the link
  between the two stages' GPUs, latency + bytes / bandwidth, bytes the
  tensor stage b sends on (`memory bytes[s]`; none stated: the latency alone),
  the slowest over the replicas;
- each stage's data-parallel gradient reduction (`dp` > 1 and `memory
  grad_bytes[s]` stated): a ring all-reduce over its replicas' GPUs, 2(n - 1)
  steps each moving bytes / n over every link of the ring, a step as long as
  its slowest link (NCCL's ring algorithm); this takes the place of `cost
  reduce[s]`. Across nodes the ring's slowest link is InfiniBand, which is the
  breadth-first paper's reason to hide the reductions behind compute.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from ppdsl.diagnostics import CompileError, Diagnostic, Span, register_source
from ppdsl.frontend.expressions import did_you_mean
from ppdsl.ir.schedule import Costs, Placement, Schedule

__all__ = ["Link", "Topology", "TopologyError", "load_topology", "parse_topology", "ring_allreduce"]

_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
"""Seconds per unit of a latency's suffix and of `time_unit`."""
_BYTE_RATES = {"B/s": 1.0, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "KiB/s": 2.0**10,
               "MiB/s": 2.0**20, "GiB/s": 2.0**30}
"""Bytes per second of a bandwidth's suffix."""
_KEYS = ("nodes", "gpus_per_node", "time_unit", "intra_latency", "intra_bandwidth",
         "inter_latency", "inter_bandwidth")
_REQUIRED = ("nodes", "gpus_per_node", "intra_latency", "intra_bandwidth")
"""What a topology must state; the inter-node link is needed only with more than one node."""
_MAX_GPUS = 1 << 20


class TopologyError(CompileError):
    """A topology that cannot be read: its located findings."""


@dataclass(frozen=True)
class Link:
    """One kind of link, in the schedule's time unit."""

    latency: float
    """What every message pays, whatever its size."""
    bandwidth: float
    """Bytes per time unit."""

    def time(self, size: float) -> float:
        """How long a message of `size` bytes takes: latency + bytes / bandwidth."""
        return self.latency + size / self.bandwidth


@dataclass(frozen=True)
class Topology:
    """Nodes of GPUs and their two links."""

    nodes: int
    """How many nodes."""
    gpus_per_node: int
    """GPUs in each node."""
    intra: Link
    """The link between two GPUs of one node (NVLink)."""
    inter: Link
    """The link between GPUs of two nodes (InfiniBand)."""
    time_unit: str = "ms"
    """The unit of the schedule's costs that the links are in."""

    @property
    def num_gpus(self) -> int:
        """Every GPU of every node."""
        return self.nodes * self.gpus_per_node

    def node_of(self, gpu: int) -> int:
        """The node of world rank `gpu` (ranks fill the nodes in order)."""
        return gpu // self.gpus_per_node

    def link(self, a: int, b: int) -> Link:
        """The link between world ranks `a` and `b`."""
        return self.intra if self.node_of(a) == self.node_of(b) else self.inter

    def edges(self, placement: Placement, transfer_bytes: tuple[float, ...], dp: int = 1
              ) -> tuple[float, ...]:
        """Per edge b (stages b and b + 1), a transfer's time over the link
        between their GPUs, the slowest over the `dp` replicas."""
        d = placement.num_devices
        sd = placement.stage_device
        out = []
        for b in range(placement.num_stages - 1):
            size = transfer_bytes[b] if transfer_bytes else 0.0
            out.append(max(self.link(k * d + sd[b], k * d + sd[b + 1]).time(size)
                           for k in range(dp)))
        return tuple(out)

    def reduction(self, rank: int, num_ranks: int, dp: int, size: float) -> float:
        """A ring all-reduce of `size` bytes over pipeline rank `rank`'s `dp`
        replicas (`ring_allreduce`)."""
        ring = [k * num_ranks + rank for k in range(dp)]
        return ring_allreduce([self.link(a, b) for a, b in zip(ring, ring[1:] + ring[:1],
                                                               strict=True)], size)

    def check_fits(self, num_ranks: int, dp: int) -> str | None:
        """Why `num_ranks` pipeline ranks times `dp` replicas do not fit these
        GPUs (None: they fit)."""
        if num_ranks * dp > self.num_gpus:
            return (f"the topology has {self.num_gpus} GPUs ({self.nodes} x {self.gpus_per_node}); "
                    f"{num_ranks} pipeline ranks x {dp} replicas need {num_ranks * dp}")
        return None

    def apply(self, costs: Costs, placement: Placement, dp: int = 1) -> Costs:
        """`costs` with every edge timed over its link and, with `dp` > 1 and
        the gradients' bytes stated, each stage's reduction over its ring (the
        module docstring); the rest as given."""
        out = replace(costs, edges=self.edges(placement, costs.transfer_bytes, dp))
        if dp > 1 and costs.grad_bytes:
            sd = placement.stage_device
            reduce = [self.reduction(sd[s], placement.num_devices, dp, costs.grad_bytes[s])
                      for s in range(placement.num_stages)]
            out = out.with_collectives({**out.declared_collectives(), "reduce": reduce})
        return out

    def apply_to(self, schedule: Schedule, dp: int = 1) -> Schedule:
        """`schedule` with its costs timed over these links (`apply`)."""
        return replace(schedule, costs=self.apply(schedule.costs, schedule.placement, dp))

    def describe(self) -> str:
        """`2 x 8 GPUs; intra 0.003 + bytes / 1.5e+08, inter ...` (in the time unit)."""
        def one(link: Link) -> str:
            return f"{link.latency:g} + bytes / {link.bandwidth:g}"

        return (f"{self.nodes} x {self.gpus_per_node} GPUs, {self.time_unit}: within a node "
                f"{one(self.intra)}, across nodes {one(self.inter)}")


def ring_allreduce(links: list[Link], size: float) -> float:
    """A ring all-reduce of `size` bytes over n members joined by `links` (one
    per member, to the next): 2(n - 1) steps (reduce-scatter, then all-gather),
    each moving size / n over every link at once and lasting as long as the
    slowest. 0 for one member."""
    n = len(links)
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * max(link.time(size / n) for link in links)


def _error(message: str, file: str, line: int, column: int, length: int) -> TopologyError:
    span = Span(file, line, column, line, column + max(length, 1) - 1)
    return TopologyError([Diagnostic("error", message, span)])


def _value(key: str, text: str, unit: float, where: tuple[str, int, int]) -> float | int | str:
    """The value of `key` as written, in the schedule's time unit (`unit`:
    seconds per time unit)."""
    file, line, column = where
    if key in ("nodes", "gpus_per_node"):
        if not re.fullmatch(r"[0-9]+", text) or not 1 <= int(text) <= _MAX_GPUS:
            raise _error(f"'{key}' is a whole number from 1 to {_MAX_GPUS}, not {text!r}",
                         file, line, column, len(text))
        return int(text)
    if key == "time_unit":
        if text not in _TIME_UNITS:
            raise _error(f"'time_unit' is one of {', '.join(_TIME_UNITS)}, not {text!r}",
                         file, line, column, len(text))
        return text
    found = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z/]*)", text)
    latency = key.endswith("latency")
    suffixes = _TIME_UNITS if latency else _BYTE_RATES
    example = "3us or 0.003 (in time_unit)" if latency else "150GB/s or 1.5e8 (bytes per time_unit)"
    if not found or (found.group(2) and found.group(2) not in suffixes):
        raise _error(f"'{key}' is a number, or one with {', '.join(suffixes)}: e.g. {example}; "
                     f"not {text!r}", file, line, column, len(text))
    number = float(found.group(1))
    suffix = found.group(2)
    if latency:
        value = number * _TIME_UNITS[suffix] / unit if suffix else number
        if not value >= 0:
            raise _error(f"'{key}' must be >= 0", file, line, column, len(text))
    else:
        value = number * _BYTE_RATES[suffix] * unit if suffix else number
        if not value > 0:
            raise _error(f"'{key}' must be more than 0 (bytes per time unit)", file, line, column,
                         len(text))
    return value


def parse_topology(text: str, file: str, separator: str = "\n") -> Topology:
    """A topology from its text (`separator`: a newline in a file, a comma on
    the command line); every error located at its line and column."""
    register_source(file, text)
    raw: dict[str, tuple[str, tuple[str, int, int]]] = {}
    line_no, offset = 1, 0
    for piece in text.split(separator):
        line = line_no if separator == "\n" else 1
        base = 0 if separator == "\n" else offset
        body = piece.split("#", 1)[0]
        if body.strip():
            if "=" not in body:
                column = base + len(body) - len(body.lstrip()) + 1
                raise _error(f"expected `key = value` ({', '.join(_KEYS)}), not "
                             f"{body.strip()!r}", file, line, column, len(body.strip()))
            key_text, value_text = body.split("=", 1)
            key = key_text.strip()
            key_column = base + len(key_text) - len(key_text.lstrip()) + 1
            if key not in _KEYS:
                hint = did_you_mean(key, _KEYS) or f"; keys are {', '.join(_KEYS)}"
                raise _error(f"unknown topology key {key!r}{hint}", file, line, key_column,
                             len(key))
            if key in raw:
                first = raw[key][1]
                raise _error(f"'{key}' is given twice (first at {first[1]}:{first[2]})", file,
                             line, key_column, len(key))
            value = value_text.strip()
            value_column = base + len(key_text) + 1 + len(value_text) - len(value_text.lstrip()) + 1
            if not value:
                raise _error(f"'{key}' needs a value", file, line, key_column, len(key))
            raw[key] = (value, (file, line, value_column))
        line_no += 1
        offset += len(piece) + 1
    unit_name = "ms"
    if "time_unit" in raw:
        unit_name = str(_value("time_unit", raw["time_unit"][0], 1.0, raw["time_unit"][1]))
    unit = _TIME_UNITS[unit_name]
    values = {k: _value(k, v, unit, where) for k, (v, where) in raw.items() if k != "time_unit"}
    for key in _REQUIRED:
        if key not in raw:
            raise _error(f"the topology does not state '{key}' (it needs "
                         f"{', '.join(_REQUIRED)}, and the inter_* link with more than one node)",
                         file, 1, 1, 1)
    nodes, gpus = int(values["nodes"]), int(values["gpus_per_node"])
    if nodes * gpus > _MAX_GPUS:
        where = raw["nodes"][1]
        raise _error(f"{nodes} x {gpus} GPUs is more than {_MAX_GPUS}", *where, len(raw["nodes"][0]))
    intra = Link(float(values["intra_latency"]), float(values["intra_bandwidth"]))
    if nodes > 1 and ("inter_latency" not in values or "inter_bandwidth" not in values):
        missing = "inter_latency" if "inter_latency" not in values else "inter_bandwidth"
        where = raw["nodes"][1]
        raise _error(f"with {nodes} nodes the topology needs the link across them: state "
                     f"'{missing}'", *where, len(raw["nodes"][0]))
    inter = Link(float(values.get("inter_latency", intra.latency)),
                 float(values.get("inter_bandwidth", intra.bandwidth)))
    return Topology(nodes, gpus, intra, inter, unit_name)


def load_topology(spec: str) -> Topology:
    """`--topology`'s value: a file's path, or `key=value` pairs separated by
    commas (a value containing '=' that names no file)."""
    path = Path(spec)
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise _error(f"cannot read the topology: {err}", spec, 1, 1, 1) from None
        return parse_topology(text, spec)
    if "=" in spec:
        return parse_topology(spec, "--topology", separator=",")
    raise _error("no such topology file (give a file, or key=value pairs separated by commas)",
                 spec, 1, 1, 1)

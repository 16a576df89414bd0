"""The terminal timeline of `ppdsl show`: one row per device, passes placed at
their simulated start times, coloured like the papers' figures (F blue, B
cyan, W green, fused backward teal), microbatch numbers written in each pass.

Nothing is cut off: a timeline wider than the terminal is wrapped into bands,
each band covering a time window and repeating every device row.
"""

from __future__ import annotations

from dataclasses import dataclass

from ppdsl.ir.schedule import PassKind, Schedule
from ppdsl.simulate import Timeline

__all__ = ["TimelineStyle", "render_timeline"]

# Background colours (ANSI 256): the zero-bubble paper draws F blue, B cyan/teal, W green.
_BG = {PassKind.F: 33, PassKind.B: 44, PassKind.W: 34, PassKind.BW: 37}
# A device's second and later chunks are drawn in a lighter shade of the same colour.
_BG_LATER_CHUNK = {PassKind.F: 75, PassKind.B: 87, PassKind.W: 78, PassKind.BW: 80}


@dataclass(frozen=True)
class TimelineStyle:
    """How to draw: `width` is the terminal width in columns; `color` uses ANSI colours."""

    width: int = 120
    color: bool = False


def _label(kind: PassKind, microbatch: int) -> str:
    return f"{'B' if kind is PassKind.BW else kind.value}{microbatch}"


def _quantum(schedule: Schedule, timeline: Timeline) -> float:
    """The time one label-wide cell stands for: the shortest pass."""
    shortest = min(
        (float(e - s) for dev in range(schedule.num_devices)
         for s, e in zip(timeline.start[dev], timeline.end[dev], strict=True) if e > s),
        default=1.0,
    )
    return shortest


def render_timeline(schedule: Schedule, timeline: Timeline, style: TimelineStyle) -> str:
    """The whole timeline as text, wrapped into bands no wider than style.width."""
    label_width = max(
        (len(_label(p.kind, p.microbatch)) for order in schedule.orders for p in order), default=2
    ) + 1
    quantum = _quantum(schedule, timeline)

    def col(t: float) -> int:
        return int(round(t / quantum * label_width))

    total_cols = max(col(float(timeline.makespan)), 1)
    gutter = len(f"rank {schedule.num_devices - 1} ")
    band_cols = max(style.width - gutter - 1, label_width * 4)

    # Each row: a list of cells (char, colour code or None).
    rows: list[list[tuple[str, int | None]]] = []
    # a band may end only where no pass is cut in two
    cuttable = [True] * (total_cols + 1)
    for dev, order in enumerate(schedule.orders):
        row: list[tuple[str, int | None]] = [(" ", None)] * total_cols
        chunks = schedule.placement.chunks(dev)
        for p, s, e in zip(order, timeline.start[dev], timeline.end[dev], strict=True):
            a, b = col(float(s)), max(col(float(e)), col(float(s)) + 1)
            later = len(chunks) > 1 and p.stage != chunks[0]
            colour: int | None = (_BG_LATER_CHUNK if later else _BG)[p.kind]
            text = _label(p.kind, p.microbatch)
            if later and not style.color:
                text = text.lower()  # without colour, a later chunk shows in lower case
            cells = (text + " " * (b - a))[: b - a]
            for k in range(a, min(b, total_cols)):
                row[k] = (cells[k - a], colour)
                if k > a:
                    cuttable[k] = False
        rows.append(row)

    out: list[str] = []
    band_start = 0
    while band_start < total_cols:
        band_end = min(band_start + band_cols, total_cols)
        if band_end < total_cols:
            safe = next(
                (c for c in range(band_end, band_start, -1) if cuttable[c]), band_end
            )
            band_end = safe
        t0 = band_start / label_width * quantum
        t1 = band_end / label_width * quantum
        out.append(f"{'':{gutter}}t = {t0:g} .. {t1:g}")
        for dev, row in enumerate(rows):
            line = [f"rank {dev}".ljust(gutter)]
            current: int | None = None
            for ch, colour in row[band_start:band_end]:
                if style.color and colour != current:
                    line.append("\x1b[0m" if colour is None else f"\x1b[30;48;5;{colour}m")
                    current = colour
                line.append(ch if (colour is not None or style.color) else ".")
            if style.color and current is not None:
                line.append("\x1b[0m")
            out.append("".join(line))
        out.append("")
        band_start = band_end
    legend = "F forward, B input-gradient backward, W weight-gradient backward"
    if not schedule.split_backward:
        legend = "F forward, B fused backward"
    if any(len(schedule.placement.chunks(d)) > 1 for d in range(schedule.num_devices)):
        legend += "; a device's later chunks " + ("lighter" if style.color else "in lower case")
    out.append(legend)
    return "\n".join(out) + "\n"

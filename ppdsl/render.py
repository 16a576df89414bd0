"""The terminal timeline of `ppdsl show`: one row per device, passes placed at
their simulated start times, coloured like the papers' figures (F blue, B
cyan, W green, fused backward teal; R recompute purple), microbatch numbers written in each pass.

Nothing is cut off: a timeline wider than the terminal is wrapped into bands,
each band covering a time window and repeating every device row.

`render_svg` draws the same timeline as an SVG figure for papers and slides:
one bar per pass, its width the pass's simulated duration.
"""

from __future__ import annotations

from dataclasses import dataclass
from xml.sax.saxutils import escape

from ppdsl.analysis.collectives import CommLanes
from ppdsl.analysis.simulate import Timeline
from ppdsl.ir.schedule import PassKind, Schedule

__all__ = ["TimelineStyle", "render_timeline", "render_svg"]

# Background colours (ANSI 256): the zero-bubble paper draws F blue, B cyan/teal, W green.
_BG = {PassKind.F: 33, PassKind.B: 44, PassKind.W: 34, PassKind.BW: 37, PassKind.R: 141}
# A device's second and later chunks are drawn in a lighter shade of the same colour.
_BG_LATER_CHUNK = {
    PassKind.F: 75, PassKind.B: 87, PassKind.W: 78, PassKind.BW: 80, PassKind.R: 183
}
# A pass kind the papers do not draw is grey until it gets its own colour.
_BG_OTHER = 245
# The data-parallel lane: gradient reductions orange, weight gathers purple.
_BG_COLLECTIVE = {"reduce": 214, "gather": 183}


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


def render_timeline(
    schedule: Schedule, timeline: Timeline, style: TimelineStyle, lanes: CommLanes | None = None
) -> str:
    """The whole timeline as text, wrapped into bands no wider than style.width;
    with `lanes`, each device's data-parallel communication lane on a row of its
    own under it (`R<stage>` a reduction, `G<stage>` a gather)."""
    label_width = max(
        (len(_label(p.kind, p.microbatch)) for order in schedule.orders for p in order), default=2
    ) + 1
    quantum = _quantum(schedule, timeline)

    def col(t: float) -> int:
        return int(round(t / quantum * label_width))

    end = max(float(timeline.makespan), lanes.makespan if lanes is not None else 0.0,
              max((c.end for lane in lanes.lanes for c in lane), default=0.0) if lanes else 0.0)
    # room for a zero-cost collective's marker at the very end
    total_cols = max(col(end), 1) + (label_width if lanes is not None else 0)
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
            colour: int | None = (_BG_LATER_CHUNK if later else _BG).get(p.kind, _BG_OTHER)
            text = _label(p.kind, p.microbatch)
            if later and not style.color:
                text = text.lower()  # without colour, a later chunk shows in lower case
            cells = (text + " " * (b - a))[: b - a]
            for k in range(a, min(b, total_cols)):
                row[k] = (cells[k - a], colour)
                if k > a:
                    cuttable[k] = False
        rows.append(row)
    names = [f"rank {dev}" for dev in range(schedule.num_devices)]
    if lanes is not None:
        merged: list[list[tuple[str, int | None]]] = []
        for dev, row in enumerate(rows):
            lane_row: list[tuple[str, int | None]] = [(" ", None)] * total_cols
            for c in lanes.lanes[dev]:
                a = col(c.start)
                text = ("R" if c.kind == "reduce" else "G") + str(c.stage)
                b = max(col(c.end), a + len(text))  # a free collective still shows its name
                cells = (text + " " * (b - a))[: b - a]
                for k in range(a, min(b, total_cols)):
                    lane_row[k] = (cells[k - a], _BG_COLLECTIVE[c.kind])
                    if k > a:
                        cuttable[k] = False
            merged += [row, lane_row]
        rows = merged
        names = [n for dev in range(schedule.num_devices) for n in (f"rank {dev}", "  dp")]

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
        for name, row in zip(names, rows, strict=True):
            line = [name.ljust(gutter)]
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
    if schedule.recompute:
        legend += ", R recompute (stages marked `recompute`)"
    if any(len(schedule.placement.chunks(d)) > 1 for d in range(schedule.num_devices)):
        legend += "; a device's later chunks " + ("lighter" if style.color else "in lower case")
    if lanes is not None:
        legend += (f"; dp lane ({lanes.mode}): R<s> stage s's gradient reduction"
                   + (", G<s> its weight gather" if lanes.mode == "shard" else ""))
    out.append(legend)
    return "\n".join(out) + "\n"


# The figures' colours: F blue, B cyan, W green, fused backward teal; a device's
# later chunks lighter.
_SVG_FILL = {PassKind.F: "#4a7fd4", PassKind.B: "#3fb8c9", PassKind.W: "#5cb85c",
             PassKind.BW: "#2a9d8f", PassKind.R: "#9b6fd4"}
_SVG_FILL_LATER = {PassKind.F: "#9dbdf0", PassKind.B: "#a3e3ec", PassKind.W: "#a8dca8",
                   PassKind.BW: "#8fd3ca", PassKind.R: "#cdb6ee"}
_SVG_FILL_OTHER = "#aaaaaa"


def render_svg(schedule: Schedule, timeline: Timeline, *, unit_px: float = 24.0) -> str:
    """The timeline as a standalone SVG document: a row per device, a bar per pass
    (x = start, width = duration, `unit_px` pixels per time unit of the shortest
    pass), the microbatch number in each bar, a time axis and a legend."""
    quantum = _quantum(schedule, timeline)
    scale = unit_px / quantum
    row_h, gap, left, top = 22, 4, 64, 28
    makespan = float(timeline.makespan)
    width = left + makespan * scale + 16
    height = top + schedule.num_devices * (row_h + gap) + 44
    title = (
        f"{schedule.name}: {schedule.num_devices} devices, {schedule.num_microbatches} "
        f"microbatches, makespan {makespan:g}, bubble {float(timeline.bubble_ratio):.4f}"
    )
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.1f}" height="{height}" '
        f'viewBox="0 0 {width:.1f} {height}" font-family="sans-serif" font-size="11">',
        f"<title>{escape(title)}</title>",
        f'<text x="{left}" y="16" font-size="13">{escape(title)}</text>',
    ]
    for dev, order in enumerate(schedule.orders):
        y = top + dev * (row_h + gap)
        out.append(f'<text x="4" y="{y + 15}">rank {dev}</text>')
        chunks = schedule.placement.chunks(dev)
        for p, s, e in zip(order, timeline.start[dev], timeline.end[dev], strict=True):
            later = len(chunks) > 1 and p.stage != chunks[0]
            fill = (_SVG_FILL_LATER if later else _SVG_FILL).get(p.kind, _SVG_FILL_OTHER)
            x, w = left + float(s) * scale, float(e - s) * scale
            label = _label(p.kind, p.microbatch)
            out.append(
                f'<rect class="pass" data-pass="{label}" data-stage="{p.stage}" '
                f'x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row_h}" fill="{fill}" '
                f'stroke="#ffffff" stroke-width="1"/>'
            )
            out.append(
                f'<text x="{x + w / 2:.2f}" y="{y + 15}" text-anchor="middle">'
                f"{p.microbatch}</text>"
            )
    axis_y = top + schedule.num_devices * (row_h + gap) + 12
    out.append(
        f'<line x1="{left}" y1="{axis_y - 8}" x2="{left + makespan * scale:.2f}" '
        f'y2="{axis_y - 8}" stroke="#888888"/>'
    )
    out.append(f'<text x="{left}" y="{axis_y + 4}">0</text>')
    out.append(
        f'<text x="{left + makespan * scale:.2f}" y="{axis_y + 4}" text-anchor="end">'
        f"{makespan:g}</text>"
    )
    kinds = (
        [(PassKind.F, "F forward"), (PassKind.B, "B input-gradient backward"),
         (PassKind.W, "W weight-gradient backward")]
        if schedule.split_backward
        else [(PassKind.F, "F forward"), (PassKind.BW, "B fused backward")]
    ) + ([(PassKind.R, "R recompute")] if schedule.recompute else [])
    x = float(left)
    for kind, text in kinds:
        out.append(
            f'<rect x="{x:.1f}" y="{axis_y + 14}" width="12" height="12" fill="{_SVG_FILL[kind]}"/>'
        )
        out.append(f'<text x="{x + 16:.1f}" y="{axis_y + 24}">{text}</text>')
        x += 16 + 7 * len(text) + 16
    out.append("</svg>")
    return "\n".join(out) + "\n"

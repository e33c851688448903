"""The dashboard's plots as inline SVG, drawn here in Python: no JavaScript, no CDN, no
build step (a lab's dashboard is often on a network with no way out). Each function
returns one `<svg>` element as text; every label is escaped (job names and messages are
the users' text). Three kinds are enough: stacked columns (the pool's timeline), a step
line with marked moments (a job's world size), horizontal bars (accounting).
"""

from __future__ import annotations

import time
from html import escape
from typing import Sequence

WIDTH, HEIGHT = 760, 220
LEFT, RIGHT, TOP, BOTTOM = 48, 12, 12, 36   # the margins around the plot area
COLORS = {"busy": "#3b6fb6", "harvested": "#e0a030", "idle": "#d8dde3", "reclaimed": "#c0392b",
          "line": "#3b6fb6", "scale": "#2e8b57", "formed": "#7f8c8d", "fault": "#c0392b", "rollback": "#8e44ad", "crash": "#c0392b",
          "bar": "#3b6fb6"}
AXIS = 'stroke="#555" stroke-width="1"'
FONT = 'font-family="sans-serif" font-size="11" fill="#333"'


def _open(width: int, height: int, label: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(label)}">'
            f'<title>{escape(label)}</title>')


def _clock(ts: float, span: float) -> str:
    """An axis label: with seconds within an hour, the time of day within two days, the
    date beyond."""
    fmt = "%H:%M:%S" if span <= 3600 else "%H:%M" if span <= 2 * 86400 else "%m-%d %H:%M" if span <= 8 * 86400 \
        else "%m-%d"
    return time.strftime(fmt, time.localtime(ts))


def _x_axis(t0: float, t1: float, width: int, height: int, ticks: int = 5) -> str:
    """The time axis under the plot area, with `ticks` + 1 labels."""
    y = height - BOTTOM
    out = [f'<line x1="{LEFT}" y1="{y}" x2="{width - RIGHT}" y2="{y}" {AXIS}/>']
    span = max(t1 - t0, 1e-9)
    for i in range(ticks + 1):
        x = LEFT + (width - LEFT - RIGHT) * i / ticks
        anchor = "start" if i == 0 else "end" if i == ticks else "middle"
        out.append(f'<text x="{x:.1f}" y="{y + 14}" text-anchor="{anchor}" {FONT}>'
                   f'{escape(_clock(t0 + span * i / ticks, span))}</text>')
    return "".join(out)


def _legend(items: Sequence[tuple[str, str]], width: int, height: int) -> str:
    out, x = [], LEFT
    for label, color in items:
        out.append(f'<rect x="{x}" y="{height - 13}" width="10" height="10" fill="{color}"/>'
                   f'<text x="{x + 14}" y="{height - 4}" {FONT}>{escape(label)}</text>')
        x += 24 + 7 * len(label)
    return "".join(out)


def stacked_columns(columns: Sequence[dict], keys: Sequence[str], *, label: str, marker: str | None = None,
                    width: int = WIDTH, height: int = HEIGHT) -> str:
    """One column per entry of `columns` ({start, end, <key>: fraction 0..1, ...}), its
    `keys` stacked bottom up, the y axis 0..100 %; with `marker`, a red tick above each
    column whose `marker` count is above 0 (the count in its tooltip)."""
    plot_h = height - TOP - BOTTOM - 16
    base = TOP + plot_h
    out = [_open(width, height + 16, label)]
    if columns:
        t0, t1 = columns[0]["start"], columns[-1]["end"]
        step = (width - LEFT - RIGHT) / len(columns)
        for i, c in enumerate(columns):
            x, y = LEFT + i * step, float(base)
            for k in keys:
                h = max(0.0, min(1.0, float(c.get(k) or 0.0))) * plot_h
                if h > 0:
                    y -= h
                    out.append(f'<rect class="{escape(k)}" x="{x:.1f}" y="{y:.1f}" width="{max(step - 1, 1):.1f}" '
                               f'height="{h:.1f}" fill="{COLORS.get(k, "#999")}"><title>{escape(k)} '
                               f'{float(c[k]) * 100:.0f}% from {escape(_clock(c["start"], t1 - t0))}</title></rect>')
            if marker and c.get(marker):
                out.append(f'<rect class="{escape(marker)}" x="{x:.1f}" y="{TOP - 8}" width="{max(step - 1, 1):.1f}" '
                           f'height="6" fill="{COLORS.get(marker, "#c00")}"><title>{int(c[marker])} {escape(marker)}'
                           f'</title></rect>')
        out.append(_x_axis(t0, t1, width, height - 16))
    out.append(f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{base}" {AXIS}/>')
    for pct in (0, 50, 100):
        y = base - plot_h * pct / 100
        out.append(f'<text x="{LEFT - 4}" y="{y + 4:.1f}" text-anchor="end" {FONT}>{pct}%</text>')
    out.append(_legend([(k, COLORS.get(k, "#999")) for k in (*keys, *((marker,) if marker else ()))],
                       width, height + 16))
    out.append("</svg>")
    return "".join(out)


def step_line(points: Sequence[tuple[float, int]], marks: Sequence[tuple[float, str, str]], *, label: str,
              width: int = WIDTH, height: int = HEIGHT) -> str:
    """A value over time as steps (`points`: (time, value from then), oldest first), and
    `marks` (time, kind, text) as vertical lines coloured by kind, the text in a tooltip.
    An empty `points` draws the axes and says there is nothing yet."""
    plot_h = height - TOP - BOTTOM
    base = TOP + plot_h
    out = [_open(width, height + 16, label)]
    times = [t for t, _ in points] + [t for t, _, _ in marks]
    if not points:
        out.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle" {FONT}>no world size yet</text>')
    else:
        t0, t1 = min(times), max(times)
        span = max(t1 - t0, 1e-9)
        top = max(1, max(v for _, v in points))

        def x(t: float) -> float:
            return LEFT + (width - LEFT - RIGHT) * (t - t0) / span

        def y(v: float) -> float:
            return base - plot_h * v / top

        path = [f"M{x(points[0][0]):.1f},{y(points[0][1]):.1f}"]
        for (_, prev), (t, v) in zip(points, points[1:]):
            path.append(f"L{x(t):.1f},{y(prev):.1f}L{x(t):.1f},{y(v):.1f}")
        out.append(f'<path class="world" d="{"".join(path)}" fill="none" stroke="{COLORS["line"]}" stroke-width="2"/>')
        for t, kind, text in marks:
            out.append(f'<line class="mark {escape(kind)}" x1="{x(t):.1f}" y1="{TOP}" x2="{x(t):.1f}" y2="{base}" '
                       f'stroke="{COLORS.get(kind, "#777")}" stroke-dasharray="4 3" stroke-width="1.5">'
                       f'<title>{escape(kind)}: {escape(text)}</title></line>')
        for v in sorted({0, top, *(v for _, v in points)}):
            out.append(f'<text x="{LEFT - 4}" y="{y(v) + 4:.1f}" text-anchor="end" {FONT}>{v}</text>')
        out.append(_x_axis(t0, t1, width, height))
    out.append(f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{base}" {AXIS}/>')
    kinds = sorted({k for _, k, _ in marks})
    out.append(_legend([("world size", COLORS["line"])] + [(k, COLORS.get(k, "#777")) for k in kinds],
                       width, height + 16))
    out.append("</svg>")
    return "".join(out)


def hbars(rows: Sequence[tuple[str, float]], *, label: str, unit: str, width: int = WIDTH) -> str:
    """One horizontal bar per (name, value), longest first as given, its value written at
    its end; a bar per 22 pixels."""
    name_w = min(200, 12 + 7 * max((len(n) for n, _ in rows), default=4))
    height = TOP + 22 * max(len(rows), 1) + 8
    out = [_open(width, height, label)]
    top = max((v for _, v in rows), default=0.0)
    if not rows:
        out.append(f'<text x="{width / 2}" y="{TOP + 14}" text-anchor="middle" {FONT}>nothing in this range</text>')
    for i, (name, value) in enumerate(rows):
        y = TOP + 22 * i
        w = (width - name_w - 90) * (value / top) if top > 0 else 0.0
        out.append(f'<text x="{name_w - 6}" y="{y + 14}" text-anchor="end" {FONT}>{escape(name)}</text>'
                   f'<rect class="bar" x="{name_w}" y="{y + 3}" width="{max(w, 0.5):.1f}" height="15" '
                   f'fill="{COLORS["bar"]}"><title>{escape(name)}: {value:.3f} {escape(unit)}</title></rect>'
                   f'<text x="{name_w + w + 6:.1f}" y="{y + 14}" {FONT}>{value:.2f} {escape(unit)}</text>')
    out.append("</svg>")
    return "".join(out)

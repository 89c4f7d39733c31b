"""Draw a schedule as an SVG timeline: ranks as rows, simulated time left to right.

Each F or B is a box at the time the simulator runs it, coloured by
microbatch (F light, B dark and hatched, W in between) and labelled `stage kind mb`
(`2F3`); the grey row behind the boxes is the bubble. Hand-written SVG,
no dependencies, so a schedule can be looked at anywhere a browser runs.
"""

import colorsys
from xml.sax.saxutils import escape

from gcompile.schedule import Kind, Schedule, SimResult, simulate

BOX_WIDTH = 30
"""Pixels for the shortest compute: room for a 4-character label."""
ROW_HEIGHT, ROW_GAP = 30, 8
LEFT, TOP, BOTTOM, RIGHT = 64, 52, 34, 16
FONT = "ui-monospace, Menlo, Consolas, monospace"
GLYPH_WIDTH = 0.62
"""A monospace glyph's advance per unit of font size (Menlo and DejaVu Sans Mono 0.60, Consolas 0.55), with room:
how wide the title and legend are, so that the picture is made wide enough to hold them."""
TITLE_SIZE, LEGEND_SIZE = 14, 11


def render_svg(schedule: Schedule, path: str, f_time: float = 1.0, b_time: float = 2.0, w_time: float = 1.0) -> None:
    """Simulate `schedule` and write its timeline to `path` (b_time a whole backward, w_time its W share)."""
    result = simulate(schedule, f_time, b_time, w_time)
    with open(path, "w") as f:
        f.write(_svg(schedule, result, f_time, b_time, w_time))


def _colour(mb: int, kind: Kind) -> tuple[str, str]:
    """(fill, text) as hex, which every SVG reader takes; the golden-angle hue keeps neighbouring microbatches apart."""
    hue = (mb * 0.381966) % 1.0
    lightness, saturation, ink = {Kind.F: (0.80, 0.70, "#1f2937"), Kind.B: (0.38, 0.55, "#ffffff"),
                                  Kind.W: (0.58, 0.45, "#111827")}[kind]
    red, green, blue = colorsys.hls_to_rgb(hue, lightness, saturation)
    return f"#{round(red * 255):02x}{round(green * 255):02x}{round(blue * 255):02x}", ink


def _svg(schedule: Schedule, result: SimResult, f_time: float, b_time: float, w_time: float) -> str:
    if schedule.splits_backward:
        costs = f"F={f_time:g} light, B={b_time - w_time:g} dark, W={w_time:g} mid"
        shortest = min(f_time, b_time - w_time, w_time)
    else:
        costs, shortest = f"F={f_time:g} light, B={b_time:g} dark", min(f_time, b_time)
    scale = BOX_WIDTH / shortest  # pixels per unit of simulated time
    title = (f"{schedule.name}  pp={schedule.pp} vpp={schedule.vpp} m={schedule.num_microbatches}  "
             f"makespan {result.makespan:g}  bubble {result.bubble_fraction:.1%}")
    legend = f"{costs}; label = stage, kind, microbatch; grey = idle"
    text_width = max(len(title) * TITLE_SIZE, len(legend) * LEGEND_SIZE) * GLYPH_WIDTH
    width = LEFT + max(result.makespan * scale, text_width) + RIGHT  # a short timeline still shows the whole title
    height = TOP + schedule.pp * (ROW_HEIGHT + ROW_GAP) + BOTTOM
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height}" '
        f'viewBox="0 0 {width:.0f} {height}" font-family="{FONT}">',
        '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><line x1="0" y1="0" x2="0" y2="6" stroke="#ffffff" '
        'stroke-opacity="0.3" stroke-width="2"/></pattern></defs>',
        f'<rect width="{width:.0f}" height="{height}" fill="#ffffff"/>',
        f'<text x="{LEFT}" y="20" font-size="{TITLE_SIZE}" font-weight="bold" fill="#111827">{escape(title)}</text>',
        f'<text x="{LEFT}" y="38" font-size="{LEGEND_SIZE}" fill="#6b7280">{escape(legend)}</text>',
    ]
    for rank, spans in enumerate(result.spans):
        y = TOP + rank * (ROW_HEIGHT + ROW_GAP)
        parts.append(f'<text x="{LEFT - 8}" y="{y + ROW_HEIGHT / 2 + 4}" font-size="12" text-anchor="end" '
                     f'fill="#374151">rank {rank}</text>')
        parts.append(f'<rect x="{LEFT}" y="{y}" width="{result.makespan * scale:.1f}" height="{ROW_HEIGHT}" '
                     f'fill="#e5e7eb" rx="2"/>')
        for span in spans:
            a = span.action
            x, w = LEFT + span.start * scale, (span.end - span.start) * scale
            fill, ink = _colour(a.mb, a.kind)
            label = str(a)
            size = min(11.0, (w - 4) / (0.62 * len(label)))
            word = {Kind.F: "forward", Kind.B: "backward", Kind.W: "weight-gradient backward"}[a.kind]
            parts.append(f'<g><title>stage {a.stage} {word} mb {a.mb}: t={span.start:g} to {span.end:g}</title>'
                         f'<rect x="{x + 0.5:.1f}" y="{y + 0.5}" width="{w - 1:.1f}" height="{ROW_HEIGHT - 1}" '
                         f'fill="{fill}" stroke="#374151" stroke-width="0.6" rx="2"/>')
            if a.kind == Kind.B:
                parts.append(f'<rect x="{x + 0.5:.1f}" y="{y + 0.5}" width="{w - 1:.1f}" '
                             f'height="{ROW_HEIGHT - 1}" fill="url(#hatch)" rx="2"/>')
            parts.append(f'<text x="{x + w / 2:.1f}" y="{y + ROW_HEIGHT / 2 + size / 3:.1f}" '
                         f'font-size="{size:.1f}" text-anchor="middle" fill="{ink}">{label}</text></g>')
    parts += _axis(result.makespan, scale, TOP + schedule.pp * (ROW_HEIGHT + ROW_GAP))
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _axis(makespan: float, scale: float, y: float) -> list[str]:
    """Time ticks under the rows, about every 60 px."""
    step = max(1, round(60 / scale))
    parts = [f'<line x1="{LEFT}" y1="{y}" x2="{LEFT + makespan * scale:.1f}" y2="{y}" stroke="#9ca3af"/>']
    t = 0
    while t <= makespan:
        x = LEFT + t * scale
        parts.append(f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 4}" stroke="#9ca3af"/>'
                     f'<text x="{x:.1f}" y="{y + 16}" font-size="10" text-anchor="middle" '
                     f'fill="#6b7280">{t:g}</text>')
        t += step
    return parts

"""Small charts as inline SVG, drawn on the server: no chart library, no script.

A chart is a row of (stacked) bars, one per time bucket, each segment with a ``<title>``
that a browser shows on hover, and the largest total on the axis.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

from markupsafe import Markup, escape

# Colour-blind-safe (Okabe-Ito), in order of the series.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#999")
WIDTH, HEIGHT, AXIS = 480, 120, 36


def colour(index: int) -> str:
    return PALETTE[index % len(PALETTE)]


def bar_chart(
    title: str,
    labels: Sequence[datetime],
    series: Mapping[str, Sequence[float]],
    *,
    unit: str = "",
    chart_id: str = "",
) -> Markup:
    """Stacked bars of ``series`` (name → one value per label), oldest bucket left."""
    count = max(1, len(labels))
    totals = [sum(values[i] for values in series.values()) for i in range(len(labels))]
    top = max(totals, default=0) or 1
    slot = (WIDTH - AXIS) / count
    parts = [
        f'<svg class="chart" id="{escape(chart_id)}" viewBox="0 0 {WIDTH} {HEIGHT + 18}" '
        f'role="img" aria-label="{escape(title)}"><title>{escape(title)}</title>',
        f'<text x="0" y="10" class="axis">{_number(top)}{escape(unit)}</text>',
        f'<text x="0" y="{HEIGHT}" class="axis">0</text>',
        f'<line x1="{AXIS}" y1="{HEIGHT}" x2="{WIDTH}" y2="{HEIGHT}" class="base"/>',
    ]
    for i, label in enumerate(labels):
        base = float(HEIGHT)
        for position, (name, values) in enumerate(series.items()):
            value = values[i]
            if not value:
                continue
            height = value / top * (HEIGHT - 14)
            base -= height
            tip = f"{name}: {_number(value)}{unit} at {label:%Y-%m-%d %H:%M} UTC"
            parts.append(
                f'<rect x="{AXIS + i * slot + 1:.1f}" y="{base:.1f}" '
                f'width="{max(slot - 2, 1):.1f}" height="{height:.1f}" '
                f'fill="{colour(position)}"><title>{escape(tip)}</title></rect>'
            )
    if labels:
        # Times of day within a day; the date too over longer spans.
        shape = "%H:%M" if labels[-1] - labels[0] < timedelta(days=1) else "%Y-%m-%d %H:%M"
        parts.append(f'<text x="{AXIS}" y="{HEIGHT + 14}" class="axis">{labels[0]:{shape}}</text>')
        parts.append(
            f'<text x="{WIDTH}" y="{HEIGHT + 14}" class="axis" text-anchor="end">'
            f"{labels[-1]:{shape}} UTC</text>"
        )
    parts.append("</svg>")
    return Markup("".join(parts))  # noqa: S704 - every value in it is escaped or a number


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) and not value.is_integer() else f"{value:.0f}"

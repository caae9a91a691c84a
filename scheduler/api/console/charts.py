"""Small charts as inline SVG, drawn on the server: no chart library, no script.

A chart is a row of (stacked) bars, one per time bucket, each segment with a ``<title>``
that a browser shows on hover, and the largest total above them. It is drawn at its card's
width: the SVG has no ``viewBox`` to scale it, its horizontal positions are percentages of
its width and its vertical ones pixels, so its text keeps the stylesheet's size (12 px)
whatever the card's width.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

from markupsafe import Markup, escape

# Colour-blind-safe (Okabe-Ito), in order of the series.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#999")
TOP, BARS, BOTTOM = 20, 110, 22  # pixels: the largest total's line, the bars, the times
GAP = 0.12  # of a bucket's width, left between two bars


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
    """Stacked bars of ``series`` (name → one value per label), oldest bucket left;
    ``unit`` follows every amount (" items", " USD")."""
    count = max(1, len(labels))
    totals = [sum(values[i] for values in series.values()) for i in range(len(labels))]
    top = max(totals, default=0)
    slot = 100 / count
    base = TOP + BARS
    parts = [
        f'<svg class="chart" id="{escape(chart_id)}" width="100%" height="{base + BOTTOM}" '
        f'role="img" aria-label="{escape(title)}"><title>{escape(title)}</title>',
        f'<text x="0" y="13" class="axis">{"most" if top else "none"}'
        f"{f' {_number(top)}{escape(unit)}' if top else ''} per bucket</text>",
        f'<line x1="0" y1="{TOP}" x2="100%" y2="{TOP}" class="grid"/>',
        f'<line x1="0" y1="{base}" x2="100%" y2="{base}" class="base"/>',
    ]
    for i, label in enumerate(labels):
        bottom = float(base)
        for position, (name, values) in enumerate(series.items()):
            value = values[i]
            if not value:
                continue
            height = value / top * BARS
            bottom -= height
            tip = f"{name}: {_number(value)}{unit} at {label:%Y-%m-%d %H:%M} UTC"
            parts.append(
                f'<rect x="{(i + GAP / 2) * slot:.3f}%" y="{bottom:.1f}" '
                f'width="{slot * (1 - GAP):.3f}%" height="{height:.1f}" '
                f'fill="{colour(position)}"><title>{escape(tip)}</title></rect>'
            )
    if labels:
        # Times of day within a day; the date too over longer spans.
        shape = "%H:%M" if labels[-1] - labels[0] < timedelta(days=1) else "%Y-%m-%d %H:%M"
        parts.append(f'<text x="0" y="{base + 16}" class="axis">{labels[0]:{shape}}</text>')
        parts.append(
            f'<text x="100%" y="{base + 16}" class="axis" text-anchor="end">'
            f"{labels[-1]:{shape}} UTC</text>"
        )
    parts.append("</svg>")
    return Markup("".join(parts))  # noqa: S704 - every value in it is escaped or a number


def _number(value: float) -> str:
    """Whole numbers as they are, others to four significant digits; no exponents."""
    if float(value).is_integer():
        return f"{value:,.0f}"
    return f"{value:,.2f}" if abs(value) >= 100 else f"{value:.4g}"

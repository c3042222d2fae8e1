"""The conversion curve of :mod:`benchmarks.bench_convert_scale` as a small self-written SVG.

Two panels over parameters (billions): peak anonymous memory (GB) per conversion with the bound
2 x largest tensor + 0.5 GB, and throughput (MB/s) per conversion with the 150 MB/s goal.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

COLOURS = {"to_hf": "#1f77b4", "reshard": "#d62728", "from_hf": "#2ca02c", "to_torch_dist": "#9467bd",
           "torch_dist_to_hf": "#ff7f0e"}  # fmt: skip
W, H, PAD = 360, 240, 46


def _panel(x0: int, title: str, xs: list[float], series: dict[str, list[float]], goal: list[float],
           goal_label: str, xmax: float) -> list[str]:  # fmt: skip
    """One panel's SVG elements: axes, ticks, a polyline per series and the dashed goal line."""
    ymax = max([*goal, *(v for ys in series.values() for v in ys)]) * 1.15 or 1.0

    def pt(x: float, y: float) -> str:
        return f"{x0 + PAD + x / xmax * (W - PAD - 10):.1f},{H - PAD + 10 - y / ymax * (H - PAD - 20):.1f}"

    out = [f'<text x="{x0 + W / 2}" y="16" text-anchor="middle" font-size="13">{title}</text>',
           f'<polyline fill="none" stroke="#000" points="{pt(0, ymax)} {pt(0, 0)} {pt(xmax, 0)}"/>']  # fmt: skip
    for i in range(5):
        y = ymax * i / 4
        px, py = pt(0, y).split(",")
        out.append(
            f'<text x="{float(px) - 4}" y="{float(py) + 4}" text-anchor="end" font-size="10">{y:.3g}</text>'
        )
    for x in xs:
        px, py = pt(x, 0).split(",")
        out.append(f'<text x="{px}" y="{float(py) + 14}" text-anchor="middle" font-size="10">{x:.2g}</text>')
    out.append(
        f'<text x="{x0 + W / 2}" y="{H + 8}" text-anchor="middle" font-size="11">parameters (B)</text>'
    )
    line = " ".join(pt(x, g) for x, g in zip(xs, goal, strict=True))
    out.append(f'<polyline fill="none" stroke="#888" stroke-dasharray="4 3" points="{line}"/>')
    out.append(
        f'<text x="{x0 + W - 12}" y="30" text-anchor="end" font-size="10" fill="#666">{goal_label}</text>'
    )
    for name, ys in series.items():
        line = " ".join(pt(x, y) for x, y in zip(xs, ys, strict=True))
        out.append(
            f'<polyline fill="none" stroke="{COLOURS.get(name, "#000")}" stroke-width="2" points="{line}"/>'
        )
    return out


def write_svg(points: Sequence[dict[str, object]], path: Path) -> None:
    """Write the two panels (memory, throughput) of the measured ``points`` to ``path``."""
    xs = [float(p["params"]) / 1e9 for p in points]  # type: ignore[arg-type]
    xmax = max(xs) * 1.05
    convs = [c for c in COLOURS if all(c in p for p in points)]
    mem = {c: [float(p[c]["peak_anon_gb"]) for p in points] for c in convs}  # type: ignore[index]
    speed = {c: [float(p[c]["mb_per_s"]) for p in points] for c in convs}  # type: ignore[index]
    bound = [float(p["anon_bound_gb"]) for p in points]  # type: ignore[arg-type]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * W}" height="{H + 60}" '
             f'font-family="sans-serif"><rect width="100%" height="100%" fill="#fff"/>']  # fmt: skip
    parts += _panel(0, "peak anonymous memory (GB)", xs, mem, bound, "2 x largest tensor + 0.5 GB", xmax)
    parts += _panel(W, "throughput (MB/s)", xs, speed, [150.0] * len(xs), "goal 150 MB/s", xmax)
    for i, c in enumerate(convs):
        x = 20 + i * 140
        parts.append(f'<rect x="{x}" y="{H + 26}" width="12" height="4" fill="{COLOURS[c]}"/>'
                     f'<text x="{x + 16}" y="{H + 32}" font-size="11">{c}</text>')  # fmt: skip
    parts.append("</svg>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts) + "\n")

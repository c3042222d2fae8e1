"""The leaderboard's figures, rendered with matplotlib's Agg canvas into PNG bytes (no pyplot state).

* *Metric vs parameter count*: one panel per column with at least two points that have a
  parameter count; log x, and log y for perplexities. Runs are filled circles, the paper's
  reference points hollow markers (one shape per table) named with their table number; a
  reference without a parameter count (the previous state of the art) is a dashed line.
* *Learning curves*: only for models with results at two or more training iterations.

Points are named in one legend below the panels (colours and shapes are the same in every
panel), never by text next to a point, so labels cannot overlap each other or leave the axes.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from mlm_eval.report.board import Leaderboard, Row
from mlm_eval.report.columns import Column

MAX_PANELS = 6
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#7f7f7f")
_REF_MARKERS = {"Table 3": "*", "Table 5": "D"}


@dataclass(frozen=True, kw_only=True)
class Plot:
    """One embedded figure."""

    title: str
    png: bytes
    description: str


def render_plots(board: Leaderboard) -> list[Plot]:
    """The figures worth drawing (possibly none), as PNG."""
    return [Plot(title=title, description=text, png=_png(fig)) for title, text, fig in plot_figures(board)]


def plot_figures(board: Leaderboard) -> list[tuple[str, str, Figure]]:
    """(title, description, figure) of each figure worth drawing."""
    out = []
    params_cols = [  # two points at least, one of them a run (the paper alone is its own table)
        c
        for c in _ordered(board)
        if len(_param_points(board, c)) >= 2 and any(not r.reference for r in _param_points(board, c))
    ]
    if params_cols:
        text = (
            "parameters on a log axis, perplexities on a log axis; filled circles are runs, hollow "
            "markers the paper's reference points (dashed: a reference without a size); partial and "
            "sample-data results are not plotted"
        )
        out.append(("Metric vs parameter count", text, _params_figure(board, params_cols[:MAX_PANELS])))
    curve_cols = [c for c in _ordered(board) if _curves(board, c)]
    if curve_cols:
        text = "models evaluated at two or more training iterations"
        out.append(
            (
                "Learning curves: metric vs training iteration",
                text,
                _curve_figure(board, curve_cols[:MAX_PANELS]),
            )
        )
    return out


def _ordered(board: Leaderboard) -> list[Column]:
    """The ranking column first, then the paper's methods, then other methods."""
    return sorted(board.columns, key=lambda c: (c.key != board.sort_column.key, c.method_tag != ""))


def _plotted(row: Row, col: Column) -> bool:
    """Comparable values only: partial and sample-data results would distort the axes."""
    return col.key in row.cells and row.cells[col.key].comparable


def _param_points(board: Leaderboard, col: Column) -> list[Row]:
    return [r for r in board.rows if r.parameters and _plotted(r, col)]


def _curves(board: Leaderboard, col: Column) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for r in board.rows:
        if not r.reference and r.iteration is not None and _plotted(r, col):
            series.setdefault(r.name, []).append((r.iteration, r.cells[col.key].value))
    return {name: sorted(pts) for name, pts in series.items() if len({i for i, _ in pts}) >= 2}


def _figure(n: int) -> tuple[Figure, list[Any]]:
    ncols = min(3, n)
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(4.4 * ncols, 3.1 * nrows + 0.9), layout="constrained")
    FigureCanvasAgg(fig)  # explicit Agg canvas: no pyplot, no GUI backend, no global state
    return fig, [fig.add_subplot(nrows, ncols, i + 1) for i in range(n)]


def _styles(board: Leaderboard) -> dict[int, dict[str, Any]]:
    """A fixed style per row (by index): a colour per run, a hollow shape per reference."""
    out: dict[int, dict[str, Any]] = {}
    runs = refs = 0
    repeated = {r.name for r in board.rows if [x.name for x in board.rows].count(r.name) > 1}
    for i, r in enumerate(board.rows):
        if r.reference:
            color = _COLORS[(refs + 3) % len(_COLORS)]
            marker = _REF_MARKERS.get(r.table or "", "s")
            out[i] = dict(marker=marker, s=90 if marker == "*" else 45, facecolors="none", edgecolors=color,
                          linewidths=1.4, color=color, label=f"{r.name} (paper {r.table})")  # fmt: skip
            refs += 1
        else:
            color = _COLORS[runs % len(_COLORS)]
            label = f"{r.name} (iter {_short(r.iteration)})" if r.name in repeated else r.name
            out[i] = dict(marker="o", s=36, facecolors=color, edgecolors="white", linewidths=0.6, color=color,
                          label=label)  # fmt: skip
            runs += 1
    return out


def _short(n: float | None) -> str:
    """1500000 -> 1.5M, 300000 -> 300k (tick labels and legend)."""
    if n is None:
        return "?"
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.3g}"


def _log_axis(axis: Any, values: Sequence[float], *, short: bool) -> None:
    """A log axis spanning at least a factor 10 (so it has labelled ticks), plain tick labels at
    1, 2 and 5 times powers of ten, no minor labels."""
    low, high = min(values), max(values)
    pad = max(math.sqrt(10 * low / high), 1.3)
    axis.axes.set(**{f"{axis.axis_name}lim": (low / pad, high * pad)})
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0), numticks=8))
    axis.set_major_formatter(FuncFormatter(lambda v, _: _short(v) if short else f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _axes_style(ax: Any, col: Column, *, log_x: bool, xs: Sequence[float], ys: Sequence[float]) -> None:
    if log_x:
        ax.set_xscale("log")
        _log_axis(ax.xaxis, xs, short=True)
    else:
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _short(v)))
    if col.perplexity:
        ax.set_yscale("log")
        _log_axis(ax.yaxis, ys, short=False)
    elif col.percent:
        low, high = ax.get_ylim()
        ax.set_ylim(max(low, 0.0) if low > -1 else low, min(high, 101.0))
    ax.set_title(col.label, fontsize=9)
    ax.set_ylabel(col.unit or col.metric_label, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(True, which="major", alpha=0.3)


def _params_figure(board: Leaderboard, cols: Sequence[Column]) -> Figure:
    fig, axes = _figure(len(cols))
    styles = _styles(board)
    used: dict[int, None] = {}
    for ax, col in zip(axes, cols, strict=True):
        xs: list[float] = []
        ys: list[float] = []
        for i, r in enumerate(board.rows):
            if not _plotted(r, col):
                continue
            st = {k: v for k, v in styles[i].items() if k not in ("label", "color")}
            value = r.cells[col.key].value
            if r.parameters:
                ax.scatter([r.parameters], [value], zorder=3, **st)
                xs.append(r.parameters)
            elif r.reference:  # e.g. the previous state of the art: a level, not a model size
                ax.axhline(value, color=styles[i]["color"], linestyle="--", linewidth=1)
            else:
                continue
            ys.append(value)
            used[i] = None
        _axes_style(ax, col, log_x=True, xs=xs, ys=ys)
        ax.set_xlabel("parameters", fontsize=8)
    _legend(fig, board, styles, list(used))
    return fig


def _curve_figure(board: Leaderboard, cols: Sequence[Column]) -> Figure:
    fig, axes = _figure(len(cols))
    styles = _styles(board)
    first_row = {r.name: i for i, r in reversed(list(enumerate(board.rows)))}
    used: dict[int, None] = {}
    for ax, col in zip(axes, cols, strict=True):
        all_x: list[float] = []
        all_y: list[float] = []
        for name, pts in sorted(_curves(board, col).items()):
            i = first_row[name]
            styles[i]["label"] = name  # one line per model name, across its iterations
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o", markersize=4, color=styles[i]["color"])
            all_x += xs
            all_y += ys
            used[i] = None
        _axes_style(ax, col, log_x=False, xs=all_x, ys=all_y)
        ax.set_xlabel("training iteration", fontsize=8)
    _legend(fig, board, styles, list(used))
    return fig


def _legend(fig: Figure, board: Leaderboard, styles: dict[int, dict[str, Any]], rows: list[int]) -> None:
    handles = []
    for i in sorted(rows):
        st = styles[i]
        dashed = board.rows[i].reference and not board.rows[i].parameters
        handles.append(
            Line2D(
                [],
                [],
                linestyle="--" if dashed else "none",
                marker=None if dashed else st["marker"],
                color=st["color"],
                markerfacecolor="none" if board.rows[i].reference else st["color"],
                markersize=7,
                label=st["label"],
            )  # fmt: skip
        )
    fig.legend(handles=handles, loc="outside lower center", ncols=min(3, max(1, len(handles))), fontsize=7,
               frameon=False)  # fmt: skip


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()

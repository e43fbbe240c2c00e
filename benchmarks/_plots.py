"""The benchmark report's figures, drawn from results (never from a live run).

Every figure names each bar with its whole label (horizontal bars, the figure
grown to fit), and draws formulas, theory and targets *above* the measured bars
(a higher ``zorder``) and in the legend, so that a measurement equal to its
formula still shows both. The format follows the file name: ``.png`` for the
report, ``.svg`` (text kept as text) for tests that read the labels back.

Example:
    >>> ratio_plot([Bar("dp: shardfn ZeRO-1", 0.97, 1.05)], "/dev/null.svg")  # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

MiB = 2**20
FASTER, SLOWER, TARGET, FORMULA = "#2a9d55", "#e07b1a", "#c0392b", "black"


class Bar(NamedTuple):
    """One bar of :func:`ratio_plot`: its full label, the ratio, and its target (or None)."""

    label: str
    value: float
    target: float | None = None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"  # SVG text stays searchable text
    return plt


def _name(bars, prefix: str) -> None:
    """Give each bar an SVG id (``prefix_0``, ...), so a test can find what is drawn over it."""
    for i, patch in enumerate(bars):
        patch.set_gid(f"{prefix}_{i}")


def _save(fig, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # "tight": nothing cut off
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def ratio_plot(bars: Sequence[Bar], path: str,
               xlabel: str = "time / the peer's (below 1: faster than the peer)") -> str:
    """Horizontal bars, one per row, with a line at 1 and each row's target drawn over it.

    Args:
        bars: the rows, top to bottom.
        path: the file written (``.png`` or ``.svg``).
        xlabel: what the ratio is.

    Returns:
        ``path``.
    """
    plt = _pyplot()
    height = 0.3 * len(bars) + 1.0
    fig, ax = plt.subplots(figsize=(7.5, height))
    ys = list(range(len(bars)))
    values = [b.value for b in bars]
    _name(ax.barh(ys, values, height=0.7, zorder=2,
                  color=[FASTER if v <= 1.0 else SLOWER for v in values]), "measured")
    ax.axvline(1.0, color="k", lw=0.8, zorder=3)
    with_target = [(y, b.target) for y, b in zip(ys, bars, strict=True) if b.target is not None]
    if with_target:
        ax.scatter([t for _, t in with_target], [y for y, _ in with_target], marker="|",
                   s=180, linewidths=2.5, color=TARGET, zorder=4, label="target",
                   gid="target")
    for y, bar in zip(ys, bars, strict=True):  # the number right of the bar and its target
        ax.text(max(bar.value, bar.target or 0.0, 1.0 if bar.value > 0.9 else 0.0), y,
                f"  {bar.value:.2f}", va="center", fontsize=7, zorder=5)
    ax.set_yticks(ys, [b.label for b in bars], fontsize=8)
    ax.set_ylim(len(bars) - 0.5, -0.5)
    ax.set_xlim(0, max([*values, *(t for _, t in with_target), 1.0]) * 1.12)
    ax.set_xlabel(xlabel)
    from matplotlib.patches import Patch

    handles = [Patch(color=FASTER, label="no slower than the peer"),
               Patch(color=SLOWER, label="slower than the peer")]
    if with_target:
        handles.append(ax.collections[0])
    ax.legend(handles=handles, loc="lower right", fontsize=7, framealpha=0.9)
    ax.grid(axis="x", alpha=0.3, zorder=0)
    return _save(fig, path)


def measured_vs_formula(groups: Sequence[str], series: dict[str, list[float]],
                        formula: dict[str, list[float]], path: str, *, title: str,
                        xlabel: str, ylabel: str, formula_label: str) -> str:
    """Grouped bars of measured values with the formula's value drawn over each bar.

    Args:
        groups: the x groups (e.g. ``["N=1", "N=2"]``).
        series: name -> one measured value per group (a bar colour each).
        formula: name -> the formula's value per group (a black tick over the bar).
        path: the file written.
        title / xlabel / ylabel: the axes' text.
        formula_label: the legend's name for the ticks ("ZeRO formula").

    Returns:
        ``path``.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        _name(ax.bar(xs, values, width=width * 0.92, color=f"C{i}",
                     label=f"{name} (measured)", zorder=2), f"measured_{i}")
        ax.scatter(xs, formula[name], marker="_", s=(width * 260) ** 2 / 4, linewidths=2.2,
                   color=FORMULA, zorder=4, label=formula_label if i == 0 else None,
                   gid=f"formula_{i}")
    ax.set_xticks(range(len(groups)), groups)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3, zorder=0)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def bubble_plot(labels: Sequence[str], measured: Sequence[float], theory: Sequence[float],
                path: str) -> str:
    """Horizontal bars of the measured pipeline bubble, the textbook value drawn over each.

    Args:
        labels: the systems, top to bottom (whole labels).
        measured / theory: fractions of the step (0.2 = 20%).
        path: the file written.

    Returns:
        ``path``.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 0.32 * len(labels) + 1.2))
    ys = list(range(len(labels)))
    _name(ax.barh(ys, [100 * m for m in measured], height=0.7, color="C0", zorder=2,
                  label="measured bubble"), "measured")
    ax.scatter([100 * t for t in theory], ys, marker="|", s=200, linewidths=2.5,
               color=FORMULA, zorder=4, label="theory (textbook)", gid="theory")
    ax.set_yticks(ys, list(labels), fontsize=8)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.set_xlabel("pipeline bubble, % of the step")
    ax.grid(axis="x", alpha=0.3, zorder=0)
    ax.legend(fontsize=7, loc="lower right", framealpha=0.9)
    return _save(fig, path)


def scaling_plots(rows: Sequence[Sequence[str]], folder: str, ext: str = "png") -> list[str]:
    """``bench_scaling.py``'s two figures from its table's rows: memory per rank and bytes
    sent per step against N, each strategy measured (bars) beside the ZeRO formula (ticks).

    Args:
        rows: the table's rows: strategy, N, measured MiB, formula MiB, ratio, measured sent
            MiB, formula sent MiB.
        folder: where ``bench_scaling_memory.<ext>`` and ``bench_scaling_comm.<ext>`` go.
        ext: ``png`` or ``svg``.

    Returns:
        The two paths.
    """
    strategies = list(dict.fromkeys(r[0] for r in rows))
    worlds = sorted({int(r[1]) for r in rows})
    cell = {(r[0], int(r[1])): r for r in rows}
    paths = []
    for measured_col, formula_col, what, name in (
            (2, 3, "params + grads + AdamW state per rank", "memory"),
            (5, 6, "bytes sent per rank per step", "comm")):
        series = {s: [float(cell[s, n][measured_col]) for n in worlds] for s in strategies}
        formula = {s: [float(cell[s, n][formula_col]) for n in worlds] for s in strategies}
        paths.append(measured_vs_formula(
            [f"N={n}" for n in worlds], series, formula,
            os.path.join(folder, f"bench_scaling_{name}.{ext}"), title=what,
            xlabel="ranks", ylabel="MiB", formula_label="ZeRO formula"))
    return paths

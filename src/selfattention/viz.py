"""Figures of attention (matplotlib). Every function returns a ``matplotlib.figure.Figure``.

Figures are built on ``matplotlib.figure.Figure`` directly — no pyplot state, no GUI backend, nothing is
ever shown — so they work headless, in threads and in tests. Save one with ``fig.savefig("a.png")``.
Chinese tokens are drawn with a CJK font when one is installed (:mod:`selfattention.fonts`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from matplotlib.figure import Figure

from .fonts import cjk_family, new_figure
from .i18n import N_, _

#: the heatmap's axis labels; in Chinese only where a CJK font can draw them (else the English ones)
AXIS_LABELS = (N_("key (attended to)"), N_("query (attending)"))

__all__ = ["attention_heatmap"]

# Annotate each cell with its value up to this many rows and columns (beyond, the numbers are unreadable).
ANNOTATE_MAX_TOKENS = 16
# Label at most this many ticks per axis; longer inputs label every n-th token.
MAX_TICK_LABELS = 64


def attention_heatmap(
    weights: torch.Tensor,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    title: str = "",
    annotate: bool | None = None,
) -> Figure:
    """A heatmap of one attention matrix: queries down the side, keys along the top.

    Cell (i, j) is the weight query token i gives key token j (row i sums to 1 for softmax weights).
    Colours use the perceptually uniform ``viridis`` map from 0 to the largest weight, with a colour bar;
    key labels are rotated so that long tokens stay readable. Beyond 64 tokens per axis only every n-th
    token is labelled (every cell is still drawn) and the figure stops growing.

    Args:
        weights: (Tq, Tk) real tensor (or anything ``torch.as_tensor`` takes), e.g.
            ``ModelRun.attentions[layer, head]``.
        row_labels: Tq query-token labels. col_labels: Tk key-token labels.
        title: figure title.
        annotate: write each value in its cell; ``None`` means yes when Tq and Tk are both
            ≤ 16 (``ANNOTATE_MAX_TOKENS``).

    Returns:
        A new ``matplotlib.figure.Figure`` (Agg canvas); size grows with the token count.

    Raises:
        ValueError: ``weights`` is not 2-D, is empty, holds NaN, or the label counts do not match its
            shape.

    >>> fig = attention_heatmap(torch.tensor([[0.67, 0.33], [0.33, 0.67]]), ["q0", "q1"], ["k0", "k1"])
    >>> type(fig).__name__, len(fig.axes)          # the heatmap and its colour bar
    ('Figure', 2)
    """
    w = torch.as_tensor(weights).detach().to("cpu", torch.float64)
    if w.dim() != 2:
        raise ValueError(f"weights must be 2-D (Tq, Tk), got shape {tuple(w.shape)}")
    n_rows, n_cols = w.shape
    if n_rows == 0 or n_cols == 0:
        raise ValueError(f"weights must not be empty, got shape {tuple(w.shape)}")
    if bool(torch.isnan(w).any()):
        raise ValueError("weights contain NaN")
    if len(row_labels) != n_rows:
        raise ValueError(f"row_labels has {len(row_labels)} labels but weights has {n_rows} rows")
    if len(col_labels) != n_cols:
        raise ValueError(f"col_labels has {len(col_labels)} labels but weights has {n_cols} columns")
    if annotate is None:
        annotate = max(n_rows, n_cols) <= ANNOTATE_MAX_TOKENS

    cell = 0.42 if annotate else 0.22  # inches per token
    width = min(16.0, max(4.5, 2.4 + cell * min(n_cols, MAX_TICK_LABELS)))
    height = min(15.0, max(3.5, 2.0 + cell * min(n_rows, MAX_TICK_LABELS)))
    fig = new_figure(figsize=(width, height), layout="constrained")
    ax = fig.add_subplot()
    finite = w[torch.isfinite(w)]
    vmax = float(finite.max()) if finite.numel() else 1.0
    vmin = min(0.0, float(finite.min())) if finite.numel() else 0.0
    if vmax <= vmin:
        vmax = vmin + 1.0
    image = ax.imshow(w.numpy(), cmap="viridis", vmin=vmin, vmax=vmax, aspect="auto", interpolation="nearest")

    # (long inputs: every n-th token is labelled, so the labels stay legible)
    x_ticks = range(0, n_cols, -(-n_cols // MAX_TICK_LABELS))
    y_ticks = range(0, n_rows, -(-n_rows // MAX_TICK_LABELS))
    ax.set_xticks(
        x_ticks, [str(col_labels[j]) for j in x_ticks], rotation=60, ha="right", rotation_mode="anchor"
    )
    ax.set_yticks(y_ticks, [str(row_labels[i]) for i in y_ticks])
    x_label, y_label = (_(t) for t in AXIS_LABELS)
    if (x_label, y_label) != AXIS_LABELS and cjk_family() is None:
        x_label, y_label = AXIS_LABELS  # no font for the Chinese: English rather than empty boxes
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.tick_params(length=0)
    font = max(5.0, min(9.0, 120.0 / min(max(n_rows, n_cols), MAX_TICK_LABELS)))
    for label in [*ax.get_xticklabels(), *ax.get_yticklabels()]:
        label.set_fontsize(font)
    if title:
        fig.suptitle(wrap_title(title, width, 11), fontsize=11)  # centred on the figure, never clipped

    if annotate:
        mid = vmin + 0.5 * (vmax - vmin)
        for i in range(n_rows):
            for j in range(n_cols):
                v = float(w[i, j])
                ax.text(
                    j,
                    i,
                    f"{v:.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="black" if v > mid else "white",  # viridis: dark low end, bright high end
                )

    bar = fig.colorbar(image, ax=ax, shrink=0.85)
    bar_label = _("attention weight")
    bar.set_label(bar_label if cjk_family() is not None else "attention weight")  # as the axis labels
    return fig


def wrap_title(title: str, width_inches: float, fontsize: float) -> str:
    """``title`` broken into lines that fit a figure ``width_inches`` wide at ``fontsize`` points.

    Estimates 0.6 em per character (wide for most glyphs; CJK count double), so a title is never clipped
    at the figure's edges.

    >>> print(wrap_title("Your journey starts: parameter-free self-attention Z = softmax(X Xᵀ) X", 4.5, 11))
    Your journey starts: parameter-free
    self-attention Z = softmax(X Xᵀ) X
    """
    import textwrap
    import unicodedata

    per_line = max(10, int(width_inches * 72 / (0.6 * fontsize)))
    wide = sum(unicodedata.east_asian_width(c) in "WF" for c in title)
    if len(title) + wide <= per_line:
        return title
    return "\n".join(textwrap.wrap(title, width=max(10, per_line - wide // 2), break_on_hyphens=False))


__all__ += ["wrap_title"]


# ---------------------------------------------------------------- head grids (the HTML report's static twin)

__all__ += ["attention_head_grid"]


def attention_head_grid(
    weights: torch.Tensor,
    title: str = "",
    gamma: float = 0.5,
    cell_inches: float = 0.9,
) -> Figure:
    """Every head at once: a grid of small heatmaps, one row per layer, one column per head.

    Colours map the weight w through w**gamma (default √w, as the HTML report does) onto ``YlGnBu``
    from 0 to 1, the same scale in every panel so heads can be compared; each panel's corner shows its
    mean entropy in bits (see :func:`selfattention.report.head_statistics`).

    Args:
        weights: (L, H, T, T) or (H, T, T) attention weights (rows sum to 1), e.g.
            ``ModelRun.attentions``.
        title: figure title.
        gamma: exponent of the colour scale (1 = linear); must be > 0.
        cell_inches: size of one panel.

    Returns:
        A new ``matplotlib.figure.Figure`` (Agg canvas) with L·H panels and a colour bar.

    Raises:
        ValueError: wrong rank, non-square panels, NaN, or ``gamma`` <= 0.

    >>> w = torch.softmax(torch.randn(2, 3, 5, 5), dim=-1)
    >>> fig = attention_head_grid(w, title="2 layers × 3 heads")
    >>> len(fig.axes)                                   # 6 panels and the colour bar
    7
    """
    from matplotlib.colors import PowerNorm

    from .report import head_statistics

    w = torch.as_tensor(weights).detach().to("cpu", torch.float64)
    if w.dim() == 3:
        w = w[None]
    if w.dim() != 4 or w.shape[-1] != w.shape[-2] or w.shape[-1] == 0:
        raise ValueError(
            f"weights must be (L, H, T, T) or (H, T, T) with T >= 1, got shape {tuple(weights.shape)}"
        )
    if bool(torch.isnan(w).any()):
        raise ValueError("weights contain NaN")
    if not gamma > 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    n_layers, n_heads, t, _ = w.shape
    entropy = head_statistics(w)["entropy"]
    fig = new_figure(
        figsize=(0.6 + cell_inches * n_heads + 0.8, 0.6 + cell_inches * n_layers + (0.4 if title else 0))
    )
    grid = fig.add_gridspec(
        n_layers, n_heads + 1, width_ratios=[1] * n_heads + [0.12], wspace=0.08, hspace=0.08
    )
    norm = PowerNorm(gamma=gamma, vmin=0.0, vmax=1.0)
    image = None
    for la in range(n_layers):
        for h in range(n_heads):
            ax = fig.add_subplot(grid[la, h])
            image = ax.imshow(
                w[la, h].numpy(), cmap="YlGnBu", norm=norm, interpolation="nearest", aspect="equal"
            )
            ax.set_xticks([])
            ax.set_yticks([])
            for side in ax.spines.values():
                side.set_linewidth(0.4)
                side.set_color("#b0b7c3")
            ax.text(
                0.97,
                0.04,
                f"{float(entropy[la, h]):.1f}",
                transform=ax.transAxes,
                ha="right",
                va="bottom",
                fontsize=6,
                color="#344054",
                bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8},
            )
            if la == 0:
                ax.set_title(f"H{h}", fontsize=8, pad=3)
            if h == 0:
                ax.set_ylabel(f"L{la}", fontsize=8, rotation=0, labelpad=12, va="center")
    bar = fig.colorbar(image, cax=fig.add_subplot(grid[:, n_heads]))
    scale = "√w" if gamma == 0.5 else f"w^{gamma:g}"
    bar.set_label(f"attention weight (colour ∝ {scale}); corner: mean entropy, bits", fontsize=7)
    bar.ax.tick_params(labelsize=6)
    top = 1 - 0.55 / fig.get_figheight()
    fig.subplots_adjust(
        left=0.55 / fig.get_figwidth(),
        right=1 - 0.5 / fig.get_figwidth(),
        bottom=0.15 / fig.get_figheight(),
        top=top,
    )
    if title:
        fig.suptitle(title, fontsize=10, y=1 - 0.12 / fig.get_figheight())
    return fig

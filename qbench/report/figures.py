"""The report's figures, each returned as PNG bytes (the HTML embeds them, the markdown links them)."""

from __future__ import annotations

import io

import numpy as np

from qbench.evals.plots import pyplot
from qbench.report.collect import Variant

COLORS = ["#222222", "#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c"]


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    pyplot().close(fig)
    return buf.getvalue()


def kld_cdf(variants: list[Variant]) -> bytes | None:
    """Per-token KLD against the baseline, as an empirical CDF on a log axis (the tail is what hurts)."""
    cands = [(i, v) for i, v in enumerate(variants) if v.kld_tokens is not None and v.kld_tokens.numel()]
    if not cands:
        return None
    fig, ax = pyplot().subplots(figsize=(6.4, 3.6))
    for i, v in cands:
        x = np.sort(np.clip(v.kld_tokens.double().numpy(), 1e-6, None))
        ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", color=COLORS[i % len(COLORS)],
                label=f"{v.name} (mean {x.mean():.3g})")
    ax.set_xscale("log")
    ax.set_xlabel("per-token KL divergence from the baseline (nats, clipped at 1e-6)")
    ax.set_ylabel("fraction of tokens ≤ x")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    return _png(fig)


def needle_heatmaps(variants: list[Variant]) -> bytes | None:
    """One length × depth heatmap per variant (kinds averaged), side by side on one colour scale."""
    runs = [v for v in variants if "needle" in v.tasks]
    if not runs:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, len(runs), figsize=(2.3 * len(runs) + 0.8, 2.8), squeeze=False, sharey=True)
    im = None
    for ax, v in zip(axes[0], runs):
        n = v.tasks["needle"]
        grid = np.mean([k["grid"] for k in n["kinds"].values()], axis=0)  # (depths, lengths)
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
        ax.set_xticks(range(len(n["lengths"])), [str(x) for x in n["lengths"]], fontsize=7)
        if ax is axes[0][0]:
            ax.set_yticks(range(len(n["depths"])), [f"{d:g}%" for d in n["depths"]], fontsize=7)
        for (r, c), val in np.ndenumerate(grid):
            ax.text(c, r, f"{val:.2f}", ha="center", va="center", fontsize=6)
        ax.set_title(f"{v.name}\n{n['score']:.2f}", fontsize=7)
        ax.set_xlabel("context tokens", fontsize=7)
    axes[0][0].set_ylabel("needle depth", fontsize=7)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="string_match_all")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _near(pts: list[tuple], logx: bool, logy: bool, tolx: float = 0.08, toly: float = 0.05) -> list[int]:
    """For each point, the index of the first point within ``tolx`` and ``toly`` of the axes' spans of it (in the
    scale each axis is drawn in; about a label's width and height): points that would print their labels over
    each other share one label."""
    import math

    def scaled(v, log):
        return math.log10(v) if log and v > 0 else v
    xs = [scaled(x, logx) for x, _, _ in pts]
    ys = [scaled(y, logy) for _, y, _ in pts]
    spanx, spany = (max(xs) - min(xs)) or 1.0, (max(ys) - min(ys)) or 1.0
    first: list[int] = []
    for i in range(len(pts)):
        anchors = [j for j in range(i) if first[j] == j and abs(xs[i] - xs[j]) <= tolx * spanx
                   and abs(ys[i] - ys[j]) <= toly * spany]
        first.append(anchors[0] if anchors else i)
    return first


def _frontier_plot(ax, pts: list[tuple], higher_is_better: bool, logx: bool = False, logy: bool = False) -> None:
    """(bytes, quality, row) points, labelled, and the dashed frontier through those that no other point beats
    on both (fewer bytes, better quality); x in MiB."""
    names: dict[int, list[str]] = {}  # variants on (nearly) one point share one label, one name per line
    for i, ((x, y, r), j) in enumerate(zip(pts, _near(pts, logx, logy))):
        ax.scatter(x / 2**20, y, color=COLORS[i % len(COLORS)], s=36, zorder=3)
        names.setdefault(j, []).append(r["name"])
    for j, same in names.items():
        ax.annotate("\n".join(same), (pts[j][0] / 2**20, pts[j][1]), fontsize=7, xytext=(4, 4),
                    textcoords="offset points", va="bottom")
    sign = -1 if higher_is_better else 1  # frontier in the order of worse-is-larger
    front, best = [], float("inf")
    for x, y, _ in sorted(pts, key=lambda p: (p[0], sign * p[1])):
        if sign * y < best:
            front.append((x / 2**20, y))
            best = sign * y
    ax.plot(*zip(*front), color="#999999", lw=1, ls="--", zorder=2, label="Pareto frontier")


def pareto(rows: list[dict], context: int) -> bytes | None:
    """Mean KLD against memory (weights + the KV cache of one ``context``-token sequence); the frontier
    joins the variants that no other variant beats on both."""
    pts = [(r["weight_bytes"] + context * r["kv_bytes_per_token"], r["kld"]["mean"] if "kld" in r else 0.0, r)
           for r in rows if r.get("weight_bytes") and r.get("kv_bytes_per_token") and ("kld" in r or r["baseline"])]
    if len(pts) < 2:
        return None
    fig, ax = pyplot().subplots(figsize=(6.4, 3.6))
    floor = min([y for _, y, _ in pts if y > 0] or [1e-4]) / 3
    _frontier_plot(ax, [(x, max(y, floor), r) for x, y, r in pts], higher_is_better=False, logy=True)
    ax.set_yscale("log")
    ax.set_xlabel(f"memory: weights + KV cache of one {context:,}-token sequence (MiB)")
    ax.set_ylabel("mean KLD vs baseline")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, title="the baseline sits at the floor", title_fontsize=7)
    return _png(fig)


def kv_pareto(rows: list[dict]) -> bytes | None:
    """Needle score against the KV bytes one 16k-token sequence holds (eviction keeps a share, quantization
    shrinks each token); the frontier joins the variants that no other beats on both. Shown when some variant
    evicts or quantizes its cache and two or more ran the needle task."""
    pts = [(r["kv_bytes_per_sequence_16k"], r["needle"]["score"], r) for r in rows
           if r.get("kv_bytes_per_sequence_16k") and "needle" in r]
    if len(pts) < 2 or len({x for x, _, _ in pts}) < 2:
        return None
    fig, ax = pyplot().subplots(figsize=(6.4, 3.6))
    _frontier_plot(ax, pts, higher_is_better=True, logx=True)
    ax.set_xscale("log")
    from matplotlib.ticker import NullFormatter
    ticks = sorted({x / 2**20 for x, _, _ in pts})  # each variant's size, instead of colliding minor labels
    ax.set_xticks(ticks, [f"{t:,.3g}" for t in ticks], fontsize=7)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("KV cache of one 16,384-token sequence (MiB)")
    ax.set_ylabel("needle score")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _png(fig)


def gsm8k_bars(rows: list[dict]) -> bytes | None:
    """Strict and flexible accuracy with Wilson 95% intervals, per variant and format."""
    fmts = [g for g in ("gsm8k", "gsm8k_cot") if any(g in r for r in rows)]
    if not fmts:
        return None
    fig, ax = pyplot().subplots(figsize=(6.4, 3.2))
    names = [r["name"] for r in rows]
    series = [(g, m) for g in fmts for m in ("strict", "flexible")]
    width = 0.8 / len(series)
    for j, (g, m) in enumerate(series):
        acc = [100 * r[g][m]["accuracy"] if g in r else np.nan for r in rows]
        lo = [100 * (r[g][m]["accuracy"] - r[g][m]["ci95"][0]) if g in r else 0 for r in rows]
        hi = [100 * (r[g][m]["ci95"][1] - r[g][m]["accuracy"]) if g in r else 0 for r in rows]
        xs = np.arange(len(rows)) + (j - (len(series) - 1) / 2) * width
        # points, not bars: an accuracy of 0 must stay visible
        ax.errorbar(xs, acc, yerr=[lo, hi], fmt="o", ms=5, capsize=3, label=f"{g} {m}", color=COLORS[(j + 1) % len(COLORS)])
    ax.set_xticks(range(len(rows)), names, rotation=20, ha="right", fontsize=7)
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(-3, 100)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    return _png(fig)

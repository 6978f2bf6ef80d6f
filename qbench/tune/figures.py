"""The two figures of the operating-point search: sensitivity per unit, and the Pareto chart of bytes against KLD."""

from __future__ import annotations

from qbench.evals.plots import pyplot
from qbench.tune.search import lower_hull


def sensitivity_figure(rows: list[dict], schemes, title: str):
    """KLD of each unit quantized alone, per scheme, with +-2 SE."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(7.0, len(rows) * 0.12), 4.0))
    x = list(range(len(rows)))
    for s in schemes:
        if s.fp:
            continue
        m = [max(r["kld"][s.name]["mean"], 1e-7) for r in rows]
        e = [2 * r["kld"][s.name]["se"] for r in rows]
        ax.errorbar(x, m, yerr=e, marker="o", ms=3, lw=1, capsize=0, label=s.name)
    ax.set_yscale("log")
    step = max(1, len(rows) // 30)
    ax.set_xticks(x[::step])
    ax.set_xticklabels([r["unit"].replace("blocks.", "") for r in rows][::step], rotation=90, fontsize=7)
    ax.set_xlabel("unit (block, or block.linear)")
    ax.set_ylabel("KLD vs fp, this unit alone quantized")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return fig


def _frontier_line(ax, points, label: str) -> None:
    pts = sorted((p for p in points if p["kld"]["mean"] > 0), key=lambda p: p["bytes"])
    best, xs, ys = float("inf"), [], []
    for p in pts:  # the staircase: at b bytes, the lowest KLD of a uniform recipe that fits in b
        best = min(best, p["kld"]["mean"])
        xs.append(p["bytes"] / 2**20)
        ys.append(best)
    if xs:
        ax.step(xs + [xs[-1] * 1.02], ys + ys[-1:], where="post", ls=":", color="grey", lw=1)
    hull = lower_hull([{"bytes": p["bytes"], "loss": p["kld"]["mean"]} for p in points])
    hx, hy = [], []
    for a, b in zip(hull, hull[1:]):  # sampled, so that a segment linear in KLD shows as one on the log axis
        if a["loss"] <= 0 or b["loss"] <= 0:
            continue  # the fp point (KLD 0) has no place on a log axis
        for i in range(41):
            t = i / 40
            hx.append(((1 - t) * a["bytes"] + t * b["bytes"]) / 2**20)
            hy.append((1 - t) * a["loss"] + t * b["loss"])
    ax.plot(hx, hy, "--", color="lightsteelblue", lw=1, label="proportional mix of two")
    for p in pts:
        ax.errorbar(p["bytes"] / 2**20, p["kld"]["mean"], yerr=2 * p["kld"]["se"], fmt="s", color="tab:blue",
                    ms=5, capsize=2)
        ax.annotate(p["name"], (p["bytes"] / 2**20, p["kld"]["mean"]), textcoords="offset points", xytext=(4, 4),
                    fontsize=7)
    ax.plot([], [], "s", color="tab:blue", label=label)


def pareto_figure(search_uniform: list[dict], tried: list[dict], held_uniform: list[dict], tuned: dict,
                  budget: float | None, title: str):
    """Left: every candidate the search tried (real KLD on the search windows; hollow: the sum of single-unit
    KLDs it predicted). Right: the held-out test windows, uniform recipes and the tuned mix with +-2 SE."""
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=False)
    _frontier_line(a, search_uniform, "uniform recipes")
    for c in tried:
        x = c["bytes"] / 2**20
        a.plot(x, max(c["predicted"], 1e-7), "o", mfc="none", color="tab:orange", ms=5)
        a.plot(x, c["kld"]["mean"], "o", color="tab:orange" if c["within"] else "tab:red", ms=5)
        a.annotate(f"r{c['round']}", (x, c["kld"]["mean"]), textcoords="offset points", xytext=(4, -10), fontsize=7)
    a.plot([], [], "o", color="tab:orange", label="candidates (real)")
    a.plot([], [], "o", mfc="none", color="tab:orange", label="candidates (predicted sum)")
    a.set_title("search: WikiText-2 valid windows", fontsize=9)
    _frontier_line(b, held_uniform, "uniform recipes")
    b.errorbar(tuned["bytes"] / 2**20, tuned["kld"]["mean"], yerr=2 * tuned["kld"]["se"], fmt="*", ms=11,
               color="tab:green", capsize=3, label=f"tuned: {tuned['name']}")
    b.set_title("held out: WikiText-2 test windows (+-2 SE)", fontsize=9)
    for ax in (a, b):
        if budget is not None:
            ax.axhline(budget, color="tab:red", lw=0.8, ls="--", label="KLD budget")
        ax.set_yscale("log")
        ax.set_xlabel("weight bytes (MiB)")
        ax.set_ylabel("mean KLD vs fp")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    return fig

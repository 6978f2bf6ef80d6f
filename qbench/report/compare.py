"""`qbench compare RUN... --out DIR`: report.md, a self-contained report.html and summary.json.

The folder is written whole or not at all (built beside DIR, then renamed into place); an existing DIR
is replaced only if it is itself a compare report.
"""

from __future__ import annotations

import json
from pathlib import Path

from qbench.paths import atomic_dir, check_output
from qbench.report import figures as fig
from qbench.report.collect import collect
from qbench.report.render import markdown, page
from qbench.report.summary import build

PARETO_CONTEXT = 8192  # the default model's window: where a KV cache costs the most


def make_figures(variants, summary: dict) -> dict[str, bytes]:
    out = {"kld_cdf": fig.kld_cdf(variants), "needle": fig.needle_heatmaps(variants),
           "pareto": fig.pareto(summary["variants"], PARETO_CONTEXT), "gsm8k": fig.gsm8k_bars(summary["variants"]),
           "kv_pareto": fig.kv_pareto(summary["variants"])}
    return {k: v for k, v in out.items() if v is not None}


def run_compare(runs: list[Path], out: Path, baseline: Path | None = None, force: bool = False) -> Path:
    out = Path(out)
    check_output(out, "report", force)
    variants = collect(runs, baseline)
    summary = build(variants)
    pngs = make_figures(variants, summary)
    summary["figures"] = sorted(pngs)
    with atomic_dir(out, "report", force) as tmp:
        (tmp / "figures").mkdir()
        for name, data in pngs.items():
            (tmp / "figures" / f"{name}.png").write_bytes(data)
        (tmp / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        (tmp / "report.md").write_text(markdown(summary, pngs))
        (tmp / "report.html").write_text(page(summary, pngs))
    return out

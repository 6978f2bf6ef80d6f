"""The bench report as a readable table."""

from __future__ import annotations

from qbench.bench.figures import spread
from qbench.bench.roofline import describe_bandwidth


def _mb(x) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def _per_token(r: dict) -> str:
    kv = r.get("kv")
    if kv is None:
        return "-"
    return f"{kv['bytes_per_token']:.0f} ({kv['vs_fp16']:.2f}x fp16)"


def render_table(report: dict) -> str:
    cfg = report["config"]
    head = (f"qbench bench  model={cfg['model']}  dtype={cfg['dtype']}  prompt={cfg['prompt_len']}  "
            f"gen={cfg['gen_len']}  threads={report['machine']['threads']}")
    m = report["machine"]
    if m.get("cpu_flags") is not None:
        head += f"\ncpu: {m['cpu']} ({' '.join(m['cpu_flags'])})"
        head += f"; kernels: {m['kernels']}" if m.get("kernels") else ""
    cols = ["backend", "batch", "prefill tok/s", "decode tok/s", "step p50 ms", "step ms by quarter",
            "weights MiB", "bits/weight", "KV B/token", "KV MiB used/reserved", "read/step MiB", "roofline",
            "peak RSS MiB", "greedy=hf"]
    rows = []
    for r in report["results"]:
        quarters = "/".join(f"{x:.0f}" for x in r["step_ms_by_quarter"])
        kv = f"{_mb(r.get('kv_bytes_used'))}/{_mb(r.get('kv_bytes_reserved'))}"
        match = r.get("greedy_match_vs_hf")
        roof = r.get("roofline")
        decode = f"{r['decode_tok_s']:.1f}"
        if "rounds" in r:  # the median round, and the range over all of them
            decode += f" ({spread(r['rounds']['decode_tok_s'], 1)})"
        rows.append([r["label"], str(r["batch"]), f"{r['prefill_tok_s']:.0f}", decode,
                     f"{r['step_ms']['p50']:.1f}", quarters, _mb(r.get("weight_bytes")),
                     "-" if r.get("bits_per_weight") is None else f"{r['bits_per_weight']:.2f}", _per_token(r), kv,
                     _mb(roof and roof["bytes_per_step"]), "-" if roof is None else f"{roof['fraction']:.0%}",
                     _mb(r.get("peak_rss_bytes")), "-" if match is None else f"{match:.0%}"])
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    bw = m.get("read_bandwidth")
    if bw is not None:
        head += f"\nread bandwidth {describe_bandwidth(bw)}; roofline = batch x bandwidth / bytes read per decode step"
    rounds = report["config"].get("rounds", 1)
    if rounds > 1:
        head += (f"\n{rounds} rounds, every case once per round in turn: a row is its median round (decode tok/s "
                 f"with its range over the rounds), a ratio the median of the rounds' ratios (range in brackets)")
    out = [head, line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows]
    if report["ratios"]:
        out.append("")
    for what, key, per_round in (("decode", "ratios", "ratio_rounds"),
                                 ("prefill", "prefill_ratios", "prefill_ratio_rounds")):
        every = report.get(per_round, {})
        shown = [f"{k} {v:.2f}x" + (f" ({spread(every[k])})" if len(every.get(k, ())) > 1 else "")
                 for k, v in sorted(report.get(key, {}).items())]
        if shown:
            out.append((f"{what} speed, qbench / peer (same round; median of the rounds): " if rounds > 1 else
                        f"{what} speed, qbench / peer (same run): ") + ", ".join(shown))
    builds = {r["llama_cpp_build"] for r in report["results"] if r.get("llama_cpp_build")}
    for b in sorted(builds):
        out.append(f"llama.cpp build: {b}")
    paths = {r["label"]: r["decode_path"] for r in report["results"] if r.get("decode_path")}
    if paths:
        out.append("qbench decode steps: " + ", ".join(f"{k} {v}" for k, v in paths.items()))
    unstable = [f"{r['label']} batch {r['batch']}" for r in report["results"]
                if r.get("same_tokens_every_round") is False]
    if unstable:
        out.append("NOT DETERMINISTIC: other greedy tokens in another round: " + ", ".join(unstable))
    for s in report.get("skipped", []):
        out.append(f"skipped: {s}")
    return "\n".join(out)

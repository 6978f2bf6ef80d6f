"""report.md and report.html from the summary: the same tables twice, the figures linked or embedded."""

from __future__ import annotations

import base64
import html

NS = "not significant"


def _f(x, fmt: str = ".3f", dash: str = "—") -> str:
    return dash if x is None else format(x, fmt)


def _pm(d: dict | None, fmt: str = ".3f", key: str = "value") -> str:
    return "—" if not d else f"{d[key]:{fmt}} ± {d['se']:{fmt}}"


def _acc(d: dict | None) -> str:
    return "—" if not d else f"{100 * d['accuracy']:.1f}% [{100 * d['ci95'][0]:.0f}, {100 * d['ci95'][1]:.0f}]"


def _mib(b) -> str:
    return "—" if b is None else f"{b / 2**20:,.1f}"


def tables(summary: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    rows = summary["variants"]
    batches = sorted({b for r in rows for b in r.get("speed", {})}, key=int)
    size = [[r["name"] + (" (baseline)" if r["baseline"] else ""), _mib(r["weight_bytes"]), _f(r["bits_per_weight"], ".2f"),
             _f(r["quantized_linear_bits_per_weight"], ".2f"), "fp32" if r["kv_scheme"] == "fp" else r["kv_scheme"], _f(r["kv_bytes_per_token"], ",.0f"),
             _mib(r.get("kv_bytes_per_sequence_16k"))]
            + [_f(r.get("speed", {}).get(b, {}).get("decode_tokens_per_s"), ".1f") for b in batches]
            + [_mib(r.get("speed", {}).get(b, {}).get("memory_bytes")) for b in batches] for r in rows]
    ctx = next((r["speed_context"] for r in rows if "speed_context" in r), None)
    size_head = (["variant", "weights MiB", "bits/weight (all)", "bits/weight (quantized linears)", "KV cache", "KV bytes/token",
                  "KV MiB, one 16k-token sequence"]
                 + [f"decode tok/s, batch {b}" for b in batches]
                 + [f"memory MiB, batch {b} @ {ctx} tokens" for b in batches])
    quality = []
    for r in rows:
        k = r.get("kld")
        n = r.get("needle")
        quality.append([
            r["name"], _pm(k, ".4f", "mean"), _f(k and k["p99"], ".3f"), _f(k and k["max"], ".2f"),
            "—" if "same_top_p" not in r else f"{100 * r['same_top_p']['mean']:.1f}%",
            "—" if "delta_p_rms" not in r else f"{100 * r['delta_p_rms']['value']:.2f}%",
            _pm(r.get("ppl"), ".2f"),
            "—" if "ppl_ratio" not in r else _pm(r["ppl_ratio"], ".4f") + ("" if r["ppl_ratio"]["significant"] else f" ({NS})"),
            "—" if not n else f"{n['score']:.2f} (" + ", ".join(
                f"{k_}: {v:.2f}" for k_, v in sorted(n["by_length"].items(), key=lambda kv: int(kv[0]))) + ")",
        ] + [_acc(r.get(g, {}).get(m)) for g in ("gsm8k", "gsm8k_cot") for m in ("strict", "flexible")])
    quality_head = ["variant", "mean KLD ± SE", "KLD p99", "KLD max", "same top", "RMS Δp", "PPL ± SE",
                    "PPL ratio ± SE", "needle (by length)", "GSM8K strict", "GSM8K flexible", "GSM8K-CoT strict",
                    "GSM8K-CoT flexible"]
    paired = [[name, t["test"], f"{t['diff']:+.3f}", f"[{t['ci95'][0]:+.3f}, {t['ci95'][1]:+.3f}]",
               f"{t['p_value']:.3g}", t["method"], "significant" if t["significant"] else NS + detectable(t.get("mde"))]
              for name, tests in summary["paired"].items() for t in tests]
    paired_head = ["variant", "paired test vs baseline", "difference", "95% CI", "p", "test", f"at α = {summary['alpha']}"]
    quality_head, quality = _drop_empty(quality_head, quality)
    return [("Size and speed", size_head, size), ("Quality against the baseline", quality_head, quality),
            ("Paired significance", paired_head, paired)]


def _sentence(s: str | None) -> str:
    return f" {s}" if s else ""


def code_line(summary: dict) -> str:
    """Which qbench code made the runs: one commit, or the groups when they differ. A run resumed on other
    code lists its commits in the order they computed it."""
    def short(c):
        return "(commit not recorded)" if not c else c[:12] + ("+dirty" if c.endswith("+dirty") else "")
    groups: dict = {}
    for name, commits in summary.get("code", {}).items():
        commits = commits if isinstance(commits, list) else [commits]
        groups.setdefault(tuple(commits), []).append(name)
    def said(commits):
        return " then ".join(short(c) for c in commits) + (" (resumed)" if len(commits) > 1 else "")
    if len(groups) <= 1:
        commits = next(iter(groups), (None,))
        return f"Code: every run by qbench {said(commits)}."
    return ("Code: the runs were made by different qbench commits (" + "; ".join(
        f"{', '.join(names)}: {said(c)}" for c, names in groups.items()) + ").")


def machine_label(m: dict) -> str:
    extra = [f"kernels {m['kernels']}" if m.get("kernels") else None, f"ATen {m['aten']}" if m.get("aten") else None,
             f"{m['threads']} threads" if m.get("threads") else None, f"torch {m['torch']}" if m.get("torch") else None]
    extra = [x for x in extra if x]
    return (m.get("cpu") or "an unnamed CPU") + (f" ({', '.join(extra)})" if extra else "")


def machine_lines(summary: dict) -> tuple[str | None, list[str]]:
    """Where the runs were computed: one sentence when every run was made on one machine, else a warning. Speed
    is each machine's, and quality figures computed off the fixed-order paths (torch's path, an fp16 or bf16 KV
    pool, qbench before stop 54) can move with another instruction set's last bits, so a report that mixes
    machines says so, and names a run resumed on another."""
    groups: dict = {}
    for name, ms in summary.get("machines", {}).items():
        groups.setdefault(tuple(machine_label(m) for m in ms) or ("(machine not recorded)",), []).append(name)
    if not groups:
        return None, []
    if len(groups) == 1 and len(next(iter(groups))) == 1:
        return f"Machine: every run on {next(iter(groups))[0]}.", []
    said = "; ".join(f"{', '.join(names)}: {' then '.join(labels)}" + (" (resumed on another machine)"
                                                                      if len(labels) > 1 else "")
                     for labels, names in groups.items())
    return None, [f"Different machines: the runs were not all computed on one machine ({said}). Speed and memory "
                  f"compare only between runs of one machine, and quality figures computed off the fixed-order "
                  f"paths (torch's path, an fp16 or bf16 KV pool, qbench before stop 54) can differ between "
                  f"instruction sets (README, \"What reproduces\")."]


def digest_lines(summary: dict) -> list[str]:
    """One warning per recipe whose variants hold different weights."""
    out = []
    for c in summary.get("digest_conflicts", []):
        groups = "; ".join(f"{', '.join(names)}: weights {d[:12]}" for d, names in c["digests"].items())
        out.append(f"Same recipe, different weights: recipe {c['recipe']} ({groups}). The recipe did not give the "
                   f"same artifact twice, so these variants compare different quantizations; each artifact's "
                   f"qbench.json says what computed its calibration (calibration_path).")
    return out


def detectable(mde: dict | None) -> str:
    """What a "not significant" is worth: the smallest difference this run could have detected."""
    if not mde:
        return ""
    if mde.get("difference") is None:
        return f"; with {mde['n']} items no difference could reach 80% power"
    note = " (no discordant pairs: discordance assumed at its 95% upper bound)" if mde["assumption"] != "observed discordance" else ""
    return f"; this run could detect differences of {100 * mde['difference']:.1f} points or more{note}"


def _drop_empty(head: list[str], rows: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    """Leave out the columns of tasks the suite did not run."""
    keep = [j for j in range(len(head)) if j == 0 or any(r[j] != "—" for r in rows)]
    return [head[j] for j in keep], [[r[j] for j in keep] for r in rows]


GUIDE = [
    ("mean KLD", "the average KL divergence, per token, between the baseline's and the variant's next-token "
                 "distributions on the same WikiText-2 tokens (llama.cpp's method, top-K plus tail, a lower bound). "
                 "0 is identical; it sees damage that perplexity averages away."),
    ("KLD p99 / max", "the worst tokens: a quantization that is fine on average can still flip rare, "
                      "important predictions."),
    ("same top", "how often the variant's most likely token equals the baseline's."),
    ("PPL ratio", "PPL(variant) / PPL(baseline) on the same chunks, with the paired error; 1.0 is no change."),
    ("needle", "RULER-style retrieval of 7-digit values hidden at a depth in a long haystack; string_match_all "
               "per cell; long contexts are where KV-cache quantization shows."),
    ("GSM8K", "lm-eval's strict-match and flexible-extract accuracy with Wilson 95% intervals; small subsets have "
              "wide intervals, so read the paired test, not the gap."),
    ("paired test", "McNemar's exact test on the same items (GSM8K, needle), or a paired z on per-token NLL "
                    "(perplexity); 'not significant' means the data cannot tell the variant from the baseline."),
    ("detectable difference", "beside every McNemar 'not significant': the smallest accuracy difference this run "
                              "would detect with 80% power at α = 0.05, from the exact power of the test at its n and "
                              "observed discordance (the share of items where exactly one of the two is right). A "
                              "larger n, or a closer variant, lowers it."),
    ("decode tok/s, memory", "measured by the suite's speed task in each run (the same prompt, EOS ignored); memory "
                             "counts weight tensors plus the KV cache at that context. Runs are timed separately, "
                             "so expect a few percent of noise."),
]

FIGURES = [("kld_cdf", "Per-token KLD, cumulative"), ("needle", "Needle retrieval: length × depth"),
           ("pareto", "Quality against size"), ("gsm8k", "GSM8K accuracy with 95% intervals"),
           ("kv_pareto", "Needle retrieval against the KV cache of one 16k-token sequence")]


def markdown(summary: dict, figures: dict[str, bytes]) -> str:
    s = summary["suite"]
    machine, machine_warnings = machine_lines(summary)
    out = [f"# qbench compare: suite `{s['name']}` (hash {s['hash']}, seed {s['seed']})", "",
           f"Baseline: **{summary['baseline']}**. Every variant ran the same suite and seed, so it saw the same "
           f"tokens, prompts and exemplars. {code_line(summary)}" + _sentence(machine), ""]
    warnings = machine_warnings + digest_lines(summary)
    out += [f"**{w}**" for w in warnings] + ([""] if warnings else [])
    for title, head, rows in tables(summary):
        out += [f"## {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(r) + " |" for r in rows] or ["| " + " | ".join(["—"] * len(head)) + " |"]
        out.append("")
    out += ["## Figures", ""]
    out += [f"![{t}](figures/{k}.png)" for k, t in FIGURES if k in figures]
    out += ["", "## How to read it", ""] + [f"- **{k}**: {v}" for k, v in GUIDE]
    return "\n".join(out) + "\n"


CSS = """body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1200px;color:#222;padding:0 16px}
table{border-collapse:collapse;margin:8px 0 20px;font-size:12.5px}th,td{border:1px solid #ccc;padding:4px 8px;
text-align:right;white-space:nowrap}th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
.ns{color:#888}.sig{color:#b00;font-weight:600}figure{display:inline-block;margin:8px 16px 8px 0}
figcaption{font-size:12px;color:#555}img{max-width:100%;border:1px solid #eee}.wrap{overflow-x:auto}"""


def page(summary: dict, figures: dict[str, bytes]) -> str:
    s = summary["suite"]
    machine, machine_warnings = machine_lines(summary)
    e = html.escape
    out = ["<!doctype html><html lang='en'><head><meta charset='utf-8'>",
           f"<title>qbench compare: {e(s['name'])}</title><style>{CSS}</style></head><body>",
           f"<h1>qbench compare: suite <code>{e(s['name'])}</code></h1>",
           f"<p>Suite hash {e(s['hash'])}, seed {s['seed']}. Baseline: <b>{e(summary['baseline'])}</b>. Every "
           f"variant ran the same suite and seed, so it saw the same tokens, prompts and exemplars. "
           f"{e(code_line(summary) + _sentence(machine))}</p>"]
    out += [f"<p class='sig'>{e(w)}</p>" for w in machine_warnings + digest_lines(summary)]
    for title, head, rows in tables(summary):
        out.append(f"<h2>{e(title)}</h2><div class='wrap'><table><tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>")
        for r in rows:
            cells = []
            for c in r:
                cls = " class='ns'" if NS in c else (" class='sig'" if c == "significant" else "")
                cells.append(f"<td{cls}>{e(c)}</td>")
            out.append("<tr>" + "".join(cells) + "</tr>")
        out.append("</table></div>")
    out.append("<h2>Figures</h2>")
    for k, t in FIGURES:
        if k in figures:
            data = base64.b64encode(figures[k]).decode()
            out.append(f"<figure><img alt='{e(t)}' src='data:image/png;base64,{data}'><figcaption>{e(t)}</figcaption></figure>")
    out.append("<h2>How to read it</h2><ul>" + "".join(f"<li><b>{e(k)}</b>: {e(v)}</li>" for k, v in GUIDE) + "</ul>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"

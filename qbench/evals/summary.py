"""A run's results as a few readable lines."""

from __future__ import annotations


def _pm(d: dict, key: str = "mean", se: str = "se", fmt: str = ".4f") -> str:
    return f"{d[key]:{fmt}} ± {d[se]:{fmt}}"


def _versus(vb: dict | None, scale: float, unit: str) -> str:
    """The paired comparison with the baseline, marked when it is not significant."""
    if not vb:
        return ""
    mde = vb["mcnemar"].get("mde") or {}
    detect = "" if mde.get("difference") is None else f"; could detect {100 * mde['difference']:.1f} points or more"
    return (f"; vs baseline {scale * vb['diff_ci']['diff']:+.3g}{unit}, McNemar p={vb['mcnemar']['p_value']:.3f}"
            + ("" if vb["mcnemar"]["significant"] else f" (not significant{detect})"))


def render_summary(record: dict) -> str:
    t = record["tasks"]
    lines = [f"{record['subject']['model']}  suite={record['suite']['name']}  seed={record['suite']['seed']}  "
             f"batch={record['batch_size']}" + (f"  baseline={record['baseline']}" if record["baseline"] else "")]
    if "kld" in t:
        k = t["kld"]
        if k.get("score") is None:
            lines.append(f"kld: baseline records stored ({k['chunks']} chunks, top-{k['top_k']}); "
                         f"PPL {_pm(k['own'], 'ppl', 'ppl_se')}")
        else:
            lines.append(f"kld: mean {_pm(k['kld'])}  p99 {k['kld']['p99']:.4f}  max {k['kld']['max']:.4f}  "
                         f"same top {100 * k['same_top_p']['mean']:.2f}%  RMS Δp {100 * k['delta_p']['rms']:.2f}%  "
                         f"PPL ratio {_pm(k['ppl_ratio'], 'value')}")
            if "top_k_check" in k:
                c = k["top_k_check"]
                lines.append(f"kld top-{k['top_k']} check on {c['tokens']} tokens: full-vocabulary {c['full_vocabulary_mean']:.4f}, "
                             f"top-K {c['top_k_mean']:.4f} ({100 * c['relative_bias']:.1f}% low)")
    if "perplexity" in t:
        p = t["perplexity"]
        r = p["lm_eval_rolling"]
        rolling = ("rolling not run (KV eviction)" if "skipped" in r else
                   f"rolling word PPL {r['word_perplexity']:.3f}, byte PPL {r['byte_perplexity']:.4f}, "
                   f"bits/byte {r['bits_per_byte']:.4f} ({r['documents']} documents)")
        lines.append(f"perplexity: llama.cpp {_pm(p['llama_cpp'], 'ppl', 'ppl_se', '.3f')} ({p['llama_cpp']['tokens']} "
                     f"tokens); {rolling}")
    for name in ("gsm8k", "gsm8k_cot"):
        if name in t:
            g = t[name]
            line = (f"{name}: strict {100 * g['strict']['accuracy']:.1f}% [{100 * g['strict']['ci95'][0]:.1f}, "
                    f"{100 * g['strict']['ci95'][1]:.1f}]  flexible {100 * g['flexible']['accuracy']:.1f}% "
                    f"({g['items']} items)")
            lines.append(line + _versus(g.get("vs_baseline", {}).get("strict"), 100, " pts"))
    if "needle" in t:
        n = t["needle"]
        kinds = ", ".join(f"{k} {v['score']:.2f}" for k, v in n["kinds"].items())
        by = ", ".join(f"{k}: {v:.2f}" for k, v in n["by_length"].items())
        line = f"needle: {n['score']:.3f} overall ({n['items']} items); {kinds}; by length {by}"
        lines.append(line + _versus(n.get("vs_baseline"), 1, ""))
    if "custom" in t:
        c = t["custom"]
        if "exact_match" in c:
            lines.append(f"custom: {100 * c['exact_match']:.0f}% of {c['items']} outputs identical to the baseline; "
                         f"median first divergence at token {c['first_divergence']['median']}")
        else:
            lines.append(f"custom: {c['items']} outputs recorded (compared when run against a baseline)")
    if "speed" in t:
        sp = t["speed"]
        per = ", ".join(f"batch {b}: {v['decode_tokens_per_s']:.1f} tok/s, {v['memory_bytes'] / 2**20:.0f} MiB"
                        for b, v in sp["batches"].items())
        lines.append(f"speed: decode after a {sp['prompt_tokens']}-token prompt: {per} (weights + KV); "
                     f"KV {sp['kv_bytes_per_token']:,} B/token")
    if "batch_invariance" in record:
        from qbench.evals.invariance import render
        lines.append(render(record["batch_invariance"]))
    return "\n".join(lines)

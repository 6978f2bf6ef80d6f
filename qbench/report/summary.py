"""The numbers of a compare report, per variant and per paired test: what summary.json holds.

Significance is never guessed from overlapping intervals: a paired difference is "significant" when
its McNemar exact p-value is below 0.05 (GSM8K, needle) or, for perplexity, when the paired 95% interval
of ln PPL(Q)/PPL(base) excludes 0.
"""

from __future__ import annotations

import math

from qbench.evals.provenance import commits_of, machines_of
from qbench.report.collect import Variant

ALPHA = 0.05
GSM8K = ("gsm8k", "gsm8k_cot")


def _get(d: dict | None, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def variant_row(v: Variant) -> dict:
    t, s = v.tasks, v.subject
    row = {"name": v.name, "run": str(v.path), "baseline": v.is_baseline, "model": s.get("model"),
           "recipe": s.get("recipe"), "kv_scheme": s.get("kv_scheme") or "fp", "weights_sha256": s.get("weights_sha256"),
           "weight_bytes": s.get("weight_bytes"), "params": s.get("params"), "bits_per_weight": s.get("bits_per_weight"),
           "quantized_linear_bits_per_weight": s.get("quantized_linear_bits_per_weight"),
           "kv_bytes_per_token": s.get("kv_bytes_per_token"), "batch_size": v.record.get("batch_size"),
           "kv_bytes_per_sequence_16k": s.get("kv_bytes_per_sequence_16k")}
    k = t.get("kld")
    if k is not None:
        row["ppl"] = {"value": k["own"]["ppl"], "se": k["own"]["ppl_se"]}
        if k.get("score") is not None:
            row["kld"] = {"mean": k["kld"]["mean"], "se": k["kld"]["se"], "median": k["kld"]["median"],
                          "p99": k["kld"]["p99"], "max": k["kld"]["max"]}
            row["same_top_p"] = k["same_top_p"]
            row["delta_p_rms"] = {"value": k["delta_p"]["rms"], "se": k["delta_p"]["rms_se"]}
            row["ppl_ratio"] = k["ppl_ratio"]
            ln = k["ln_ppl_ratio"]
            row["ppl_ratio"]["significant"] = abs(ln["value"]) > 1.96 * ln["se"]
            if "top_k_check" in k:
                row["kld_top_k_bias"] = k["top_k_check"]["relative_bias"]
    p = t.get("perplexity")
    if p is not None:
        row["wikitext_ppl"] = {"value": p["llama_cpp"]["ppl"], "se": p["llama_cpp"]["ppl_se"]}
        row["bits_per_byte"] = p["lm_eval_rolling"].get("bits_per_byte")  # None where eviction skipped it
    n = t.get("needle")
    if n is not None:
        row["needle"] = {"score": n["score"], "by_length": n["by_length"], "items": n["items"]}
    for g in GSM8K:
        if g in t:
            row[g] = {m: {"accuracy": t[g][m]["accuracy"], "ci95": t[g][m]["ci95"]} for m in ("strict", "flexible")}
            row[g]["items"] = t[g]["items"]
    c = t.get("custom")
    if c is not None and "exact_match" in c:
        row["custom"] = {"exact_match": c["exact_match"], "first_divergence_median": c["first_divergence"]["median"]}
    sp = t.get("speed")
    if sp is not None:
        row["speed"] = {b: {"decode_tokens_per_s": x["decode_tokens_per_s"], "memory_bytes": x["memory_bytes"]}
                        for b, x in sp["batches"].items()}
        row["speed_context"] = sp["prompt_tokens"] + sp["new_tokens"]
    return row


def _mcnemar_row(test: str, vb: dict) -> dict:
    """A McNemar comparison, with the smallest difference this n could detect (80% power, alpha 0.05)."""
    return {"test": test, "diff": vb["diff_ci"]["diff"], "ci95": [vb["diff_ci"]["low"], vb["diff_ci"]["high"]],
            "p_value": vb["mcnemar"]["p_value"], "method": "McNemar exact",
            "significant": vb["mcnemar"]["p_value"] < ALPHA, "mde": vb["mcnemar"].get("mde")}


def paired_tests(v: Variant) -> list[dict]:
    """Every paired comparison of this candidate with the baseline, as recorded by its eval run."""
    t, out = v.tasks, []
    for g in GSM8K:
        for m in ("strict", "flexible"):
            vb = _get(t, g, "vs_baseline", m)
            if vb:
                out.append(_mcnemar_row(f"{g} {m}", vb))
    vb = _get(t, "needle", "vs_baseline")
    if vb:
        out.append(_mcnemar_row("needle", vb))
    ln = _get(t, "kld", "ln_ppl_ratio")
    if ln and ln["se"] > 0:
        z = ln["value"] / ln["se"]
        p = math.erfc(abs(z) / math.sqrt(2))
        out.append({"test": "ln PPL ratio", "diff": ln["value"],
                    "ci95": [ln["value"] - 1.96 * ln["se"], ln["value"] + 1.96 * ln["se"]],
                    "p_value": p, "method": "paired z (per-token NLL)", "significant": p < ALPHA})
    return out


def digest_conflicts(rows: list[dict]) -> list[dict]:
    """Variants made by one recipe whose weights differ (their tensors' sha256): that recipe did not give the
    same artifact twice, so they compare two quantizations, not one (issue 21). ``[{"recipe", "digests":
    {sha256: [variant names]}}]``"""
    by: dict = {}
    for r in rows:
        if r.get("recipe") and r.get("weights_sha256"):
            by.setdefault(r["recipe"], {}).setdefault(r["weights_sha256"], []).append(r["name"])
    return [{"recipe": k, "digests": v} for k, v in by.items() if len(v) > 1]


def build(variants: list[Variant]) -> dict:
    base = variants[0]
    rows = [variant_row(v) for v in variants]
    return {"suite": {k: base.record["suite"][k] for k in ("name", "hash", "seed")},
            "baseline": base.name, "alpha": ALPHA,
            "variants": rows, "digest_conflicts": digest_conflicts(rows),
            "code": {v.name: commits_of(v.record) for v in variants},
            "machines": {v.name: machines_of(v.record) for v in variants},
            "paired": {v.name: paired_tests(v) for v in variants[1:]}}

"""How a bench's rows become its figures: the ratios between cases, greedy agreement with hf, and a bench of
several rounds, where every case runs once per round, round-robin, and each reported figure is the median over
the rounds, with its range.

On a shared 2-core host one case's speed moves by 20% or more between runs minutes apart, and a ratio of two
cases run one after the other moves with it. Running the cases round-robin exposes all of them to the same
drift, and a ratio taken within each round (both sides measured minutes apart at most) is paired: its median
over the rounds, with the range beside it, says how far a single run could have misled.
"""

from __future__ import annotations

import statistics


def combine_case(rows: list[dict]) -> dict:
    """One case's rows, one per round (in round order) -> the reported row: the round whose decode speed is
    the median (the lower middle one for an even count, so every figure in it was measured together), with the
    prefill speed's median, the largest peak RSS, and every round's figures under ``rounds``."""
    if len(rows) == 1:
        return rows[0]
    decode = [r["decode_tok_s"] for r in rows]
    mid = statistics.median_low(decode)
    out = dict(rows[decode.index(mid)])
    prefill = [r["prefill_tok_s"] for r in rows]
    out["prefill_tok_s"] = statistics.median_low(prefill)
    out["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in rows)
    out["rounds"] = {"decode_tok_s": decode, "prefill_tok_s": prefill,
                     "peak_rss_bytes": [r["peak_rss_bytes"] for r in rows]}
    if all("tokens" in r for r in rows):  # greedy decoding: every round must produce the same tokens
        out["same_tokens_every_round"] = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    return out


def combine_ratios(per_round: list[dict]) -> tuple[dict, dict]:
    """Each round's ratios (name -> value) -> (the median of each over the rounds, every round's values).
    A ratio missing from a round (a peer that crashed there) is taken over the rounds that have it."""
    values: dict[str, list[float]] = {}
    for ratios in per_round:
        for name, v in ratios.items():
            values.setdefault(name, []).append(v)
    return {name: statistics.median(v) for name, v in values.items()}, values


def spread(values: list[float], digits: int = 2) -> str:
    """'1.41-1.60': the range of a figure over the rounds."""
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}"


def agreement(results: list[dict]) -> None:
    """Record, per case, how many greedy tokens match the hf backend at the same batch size."""
    ref = {r["batch"]: r["tokens"] for r in results if r["label"] == "hf"}
    for r in results:
        toks = r.pop("tokens")
        if r["batch"] in ref and r["label"] != "hf":
            pairs = [(a, b) for x, y in zip(toks, ref[r["batch"]]) for a, b in zip(x, y)]
            r["greedy_match_vs_hf"] = sum(a == b for a, b in pairs) / max(len(pairs), 1)


def ratios(results: list[dict], speed: str = "decode_tok_s") -> dict:
    """Decode (or, with speed="prefill_tok_s", prefill) tok/s ratios from one round: qbench over each peer, and
    each quantized variant over the fp engine and over llama.cpp, per batch size."""
    by = {(r["label"], r["batch"]): r[speed] for r in results}
    out = {}
    for (label, b), tps in by.items():
        if label.startswith("qbench["):
            for ref in ("qbench", "llama.cpp"):
                if (ref, b) in by:
                    out[f"{label}/{ref}@{b}"] = tps / by[(ref, b)]
        elif label != "qbench" and ("qbench", b) in by:
            out[f"qbench/{label}@{b}"] = by[("qbench", b)] / tps
    return out

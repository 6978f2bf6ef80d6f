"""Batch invariance: the same model and KV cache run at two batch sizes (or with the prefix cache on and
off), record by record.

When a run's baseline is the same subject (same weights sha256, same KV scheme) at another setting,
the run reports whether every per-item record and every stored tensor came out identical, and where
not, how far apart they are: the item keys that differ, the largest difference of any number in them,
the largest log-prob difference in the stored chunks, and each task's score at both batch sizes.
"""

from __future__ import annotations

import math
from pathlib import Path

from safetensors.torch import load_file

from qbench.evals.store import RunStore

TIMING = {"seconds", "throughput", "items_per_s", "tokens_per_s", "generated_tokens_per_s"}


def same_subject(a: dict, b: dict) -> bool:
    sa, sb = a.get("subject", {}), b.get("subject", {})
    return sa.get("weights_sha256") == sb.get("weights_sha256") and sa.get("kv") == sb.get("kv")


def _numbers_apart(x, y) -> float:
    """The largest |x - y| over matching numbers of two JSON values; inf where their structure differs."""
    if isinstance(x, dict) and isinstance(y, dict):
        if x.keys() != y.keys():
            return math.inf
        return max((_numbers_apart(x[k], y[k]) for k in x if k not in TIMING), default=0.0)
    if isinstance(x, list) and isinstance(y, list):
        if len(x) != len(y):
            return math.inf
        return max((_numbers_apart(p, q) for p, q in zip(x, y)), default=0.0)
    if isinstance(x, bool) or isinstance(y, bool) or not isinstance(x, (int, float)) or not isinstance(y, (int, float)):
        return 0.0 if x == y else math.inf
    return abs(float(x) - float(y))


def _items(a: RunStore, b: RunStore, task: str) -> dict | None:
    ia, ib = a.load_items(task), b.load_items(task)
    if not ia and not ib:
        return None
    common = sorted(set(ia) & set(ib))
    differing = [k for k in common if ia[k] != ib[k]]
    apart = max((_numbers_apart(ia[k], ib[k]) for k in differing), default=0.0)
    return {"compared": len(common), "differing": len(differing), "first_differing": differing[:5],
            "max_abs_difference": None if math.isinf(apart) else apart, "text_differs": math.isinf(apart)}


def _parts(a: Path, b: Path) -> dict | None:
    names = sorted(p.relative_to(a / "parts") for p in (a / "parts").glob("*/*.safetensors"))
    names = [n for n in names if (b / "parts" / n).is_file()]
    if not names:
        return None
    differing, apart = 0, 0.0
    for n in names:
        ta, tb = load_file(str(a / "parts" / n)), load_file(str(b / "parts" / n))
        same = True
        for k in ta.keys() & tb.keys():  # a run against a baseline adds comparison tensors; those are not compared
            x, y = ta[k], tb[k]
            if x.shape != y.shape:
                same = False
            elif x.is_floating_point():
                d = (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
                apart = max(apart, d)
                same &= d == 0
            else:
                same &= bool((x == y).all())
        differing += not same
    return {"compared": len(names), "differing": differing, "max_abs_difference": apart}


def _own_score(task: str, res: dict):
    """The score a run earns on its own; kld's and custom's scores exist only against a baseline."""
    if task == "kld":
        return res["own"]["ppl"]
    return None if task == "custom" else res.get("score")


def compare_runs(rec: dict, out: Path, base: dict, base_dir: Path) -> dict:
    a, b = RunStore(base_dir), RunStore(out)
    report = {"batch_sizes": [base.get("batch_size"), rec.get("batch_size")],
              "prefix_cache": [base.get("prefix_cache"), rec.get("prefix_cache")], "tasks": {}}
    for task, res in rec["tasks"].items():
        other = base.get("tasks", {}).get(task)
        if other is None or task == "speed":  # wall-clock figures differ from run to run by nature
            continue
        t = {"score": [_own_score(task, other), _own_score(task, res)]}
        items = _items(a, b, task)
        if items is not None:
            t["items"] = items
        report["tasks"][task] = t
    chunks = _parts(Path(base_dir), Path(out))
    if chunks is not None:
        report["chunks"] = chunks
    report["identical"] = all(t["score"][0] == t["score"][1] and t.get("items", {}).get("differing", 0) == 0
                              for t in report["tasks"].values()) and (chunks is None or chunks["differing"] == 0)
    return report


def render(inv: dict) -> str:
    (b0, b1), (c0, c1) = inv["batch_sizes"], inv.get("prefix_cache", [None, None])
    if c0 == c1 or None in (c0, c1):
        head = f"batch invariance (batch {b1} vs {b0})"
    else:
        on = {True: "on", False: "off"}
        head = f"batch invariance (batch {b1}, prefix cache {on[c1]} vs batch {b0}, prefix cache {on[c0]})"
    if inv["identical"]:
        return f"{head}: identical records, tensors and scores"
    parts = []
    for task, t in inv["tasks"].items():
        bits = []
        if "items" in t and t["items"]["differing"]:
            i = t["items"]
            bits.append(f"{i['differing']}/{i['compared']} records differ"
                        + (" in text" if i["text_differs"] else f" (max |Δ| {i['max_abs_difference']:.2g})"))
        s0, s1 = t["score"]
        if s0 != s1 and isinstance(s0, (int, float)) and isinstance(s1, (int, float)):
            bits.append(f"score {s0:.6g} → {s1:.6g}")
        if bits:
            parts.append(f"{task}: " + ", ".join(bits))
    if inv.get("chunks", {}).get("differing"):
        c = inv["chunks"]
        parts.append(f"chunks: {c['differing']}/{c['compared']} differ, max |Δ log-prob| {c['max_abs_difference']:.2g}")
    return f"{head}: differs; " + "; ".join(parts)

"""Eval runs read into memory for a report: one ``Variant`` per run, checked against the baseline.

Everything the report says comes from these records (results.json, and the per-token KLD tensors a
candidate stored); a variant's name comes from its record (recipe and KV scheme), never from a path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from qbench.errors import QBenchError
from qbench.evals.chunks import namespace
from qbench.evals.run import read_record
from qbench.evals.store import RunStore


@dataclass
class Variant:
    name: str
    path: Path
    record: dict
    is_baseline: bool = False
    kld_tokens: torch.Tensor | None = field(default=None, repr=False)  # per-token KLD against the baseline

    @property
    def tasks(self) -> dict:
        return self.record["tasks"]

    @property
    def subject(self) -> dict:
        return self.record["subject"]


def read_run(path: Path) -> dict:
    rec = read_record(path, "run `qbench eval` into it to the end")
    for key in ("suite", "subject", "tasks"):
        if key not in rec:
            raise QBenchError(f"{Path(path) / 'results.json'}: no {key!r} field; this is not a qbench eval record")
    return rec


def label(rec: dict) -> str:
    """The recipe's name; a KV scheme given for this run only (``--kv``) is named after it."""
    s = rec["subject"]
    weights = s.get("recipe") or "fp32"
    if s.get("kv_source") == "run":
        return f"{weights} + KV {s['kv_scheme']}"
    return weights


def _kld_tokens(path: Path, rec: dict) -> torch.Tensor | None:
    cfg = rec["suite"]["tasks"].get("kld")
    if cfg is None or rec["tasks"].get("kld", {}).get("score") is None:
        return None
    store = RunStore(path)
    ns = namespace(cfg["data"], cfg["ctx"], cfg["top_k"])
    parts = [store.load_part(ns, f"chunk_{i:05d}") for i in range(rec["tasks"]["kld"]["chunks"])]
    if any(p is None or "kld" not in p for p in parts):
        raise QBenchError(f"{path}: the per-token KLD records are missing from parts/{ns}; re-run the eval")
    return torch.cat([p["kld"].float() for p in parts])


def collect(paths: list[Path], baseline: Path | None = None) -> list[Variant]:
    """The runs, baseline first; refuses any run made under another suite or seed than the baseline."""
    if not paths:
        raise QBenchError("compare: give at least one eval run folder")
    records = {Path(p): read_run(p) for p in paths}
    if baseline is not None:
        base_path = Path(baseline)
        if base_path not in records:
            records = {base_path: read_run(base_path), **records}
    else:
        roots = [p for p, r in records.items() if not r.get("baseline")]
        if len(roots) != 1:
            raise QBenchError(f"compare: {len(roots)} of the runs were made without a baseline "
                              f"({', '.join(map(str, roots)) or 'none'}); name the fp run with --baseline")
        base_path = roots[0]
    base = records[base_path]
    b = base["suite"]
    for p, r in records.items():
        s = r["suite"]
        if s.get("hash") != b.get("hash") or s.get("seed") != b.get("seed"):
            raise QBenchError(f"{p}: made under suite {s.get('name')!r} (hash {s.get('hash')}, seed {s.get('seed')}), "
                              f"the baseline {base_path} under {b.get('name')!r} (hash {b.get('hash')}, seed "
                              f"{b.get('seed')}); re-run it with the baseline's suite")
    out, seen = [], {}
    for p in [base_path] + [p for p in records if p != base_path]:
        rec = records[p]
        name = label(rec)
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:  # the same recipe twice (another batch size, say): keep both apart
            name = f"{name} (#{seen[name]}, batch {rec.get('batch_size')})"
        out.append(Variant(name, p, rec, is_baseline=p == base_path,
                           kld_tokens=None if p == base_path else _kld_tokens(p, rec)))
    return out

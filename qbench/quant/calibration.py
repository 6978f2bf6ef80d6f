"""Calibration windows from WikiText-2 valid: a seeded sample of fixed-length token windows."""

from __future__ import annotations

from pathlib import Path

import torch

from qbench.errors import QBenchError
from qbench.quant.recipe import Calibration

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def resolve_data(path: str) -> Path:
    p = Path(path)
    for cand in (p, PROJECT_ROOT / p):
        if cand.is_file():
            return cand
    raise QBenchError(f"calibration data {path}: no such file; point calibration.data at a local text file")


def calibration_windows(tokenizer, cal: Calibration) -> tuple[torch.Tensor, dict]:
    """(samples, seq_len) token ids, windows drawn without overlap with ``cal.seed``; plus a record."""
    path = resolve_data(cal.data)
    ids = tokenizer(path.read_text(encoding="utf-8"))["input_ids"]
    n_windows = len(ids) // cal.seq_len
    if n_windows < cal.samples:
        raise QBenchError(f"calibration: {path} has {len(ids)} tokens, too few for {cal.samples} windows of "
                          f"{cal.seq_len}; lower calibration.samples or seq_len")
    g = torch.Generator().manual_seed(cal.seed)
    starts = (torch.randperm(n_windows, generator=g)[: cal.samples] * cal.seq_len).tolist()
    data = torch.tensor([ids[s: s + cal.seq_len] for s in starts], dtype=torch.int64)
    record = {"data": str(cal.data), "tokens_in_file": len(ids), "samples": cal.samples, "seq_len": cal.seq_len,
              "seed": cal.seed, "window_starts": starts}
    return data, record

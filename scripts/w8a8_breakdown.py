#!/usr/bin/env python3
"""Where a W8A8 / W4A8 artifact's KL divergence comes from: the same artifact with its per-token INT8
activations switched off (fp32 inputs against the same integer weights) for every linear, then for one kind
of linear at a time.

    QBENCH_NO_KERNELS=1 .venv/bin/python scripts/w8a8_breakdown.py MODEL ARTIFACT [--windows 8]

MODEL is the fp source (a zoo name or a folder), ARTIFACT a quantized folder with `activations: int8`. KLD is
the full-vocabulary KL divergence against the fp model (`tune.reference.Reference`, llama.cpp's scoring of
a window's second half) on seeded WikiText-2 *test* windows of 512 tokens (seed 1), mean +- SE over tokens. The switch flips each linear's `activations`
attribute, which the torch path (QBENCH_NO_KERNELS=1) reads on every call; qbench's kernels keep their
int8 layout, so run it with that variable set (it refuses otherwise). Slow: a few minutes a row on Qwen.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--windows", type=int, default=8)
    args = ap.parse_args()
    if os.environ.get("QBENCH_NO_KERNELS") != "1":
        print("w8a8_breakdown: set QBENCH_NO_KERNELS=1 (the switch acts on the torch path only)", file=sys.stderr)
        return 2
    from qbench.engine.api import load_tokenizer
    from qbench.models.registry import load_model
    from qbench.models.zoo import resolve_model
    from qbench.quant.artifact import load_artifact
    from qbench.quant.calibration import calibration_windows
    from qbench.quant.qlinear import QuantLinear
    from qbench.quant.recipe import Calibration
    from qbench.tune.reference import Reference
    from qbench.tune.sensitivity import mean_se
    from qbench.tune.tune import TEST_TEXT

    folder = resolve_model(args.model)
    ids, _ = calibration_windows(load_tokenizer(folder), Calibration(TEST_TEXT, args.windows, 512, 1))
    ref = Reference(load_model(folder, torch.float32), ids, keep_inputs=False)
    qm, _ = load_artifact(args.artifact)
    mods = {n: m for n, m in qm.named_modules() if isinstance(m, QuantLinear) and m.activations == "int8"}
    if not mods:
        print(f"w8a8_breakdown: {args.artifact} has no linear with int8 activations", file=sys.stderr)
        return 2
    kinds = sorted({n.rsplit(".", 1)[-1] for n in mods})
    print(f"{args.artifact}: {len(mods)} linears with int8 activations ({', '.join(kinds)}); "
          f"{ref.tokens} scored tokens")
    print("| int8 activations off in | KLD mean | SE |\n|---|---|---|")
    for label, off in [("none", ()), ("every linear (weight-only)", tuple(kinds))] + [(k, (k,)) for k in kinds]:
        for n, m in mods.items():
            m.activations = "fp32" if n.rsplit(".", 1)[-1] in off else "int8"
        kld = mean_se(ref.replay(model=qm)["kld"])
        print(f"| {label} | {kld['mean']:.5f} | {kld['se']:.5f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

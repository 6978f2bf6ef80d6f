#!/usr/bin/env python3
"""Check the README's speed claims with `qbench bench`: one run per claim, ratios from that run (the median of
the file's `rounds`, each ratio paired within its round).

    .venv/bin/python scripts/check_speed.py [--claims scripts/speed_claims.yaml]

For each claim whose `cpu_flags` this machine has all of and whose `cpu_lacks` it has none of, it quantizes
the claimed recipes into a temporary folder, runs `qbench bench MODEL --backends qbench --variant ...` at
the claimed batch size, and compares each variant's decode tok/s over the fp32 engine's with the claim. Exit 1 when a ratio is below
claim x (1 - margin) (the file's `margin`, or a claim's own where its runs spread wider); exit 0 when every applicable claim holds or none applies (said so). Separate from
pytest: the tests never time anything.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CLAIM_KEYS = {"model", "cpu_flags", "cpu_lacks", "margin", "batch", "prompt_len", "gen_len", "over_fp32_engine"}


def qbench(*args: str) -> None:
    p = subprocess.run([sys.executable, "-m", "qbench", *args], cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"check_speed: qbench {' '.join(args[:2])} failed: {(p.stderr.strip() or p.stdout)[-400:]}")


def not_applicable(claim: dict, have: set[str]) -> str | None:
    """Why a claim does not apply on a CPU with these flags, or None when it does."""
    need, excluded = set(claim["cpu_flags"]), set(claim.get("cpu_lacks", []))
    if not need <= have:
        return f"it lacks {', '.join(sorted(need - have))}"
    if excluded & have:
        return f"the claim is for CPUs without {', '.join(sorted(excluded & have))}"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--claims", default=str(ROOT / "scripts" / "speed_claims.yaml"))
    args = ap.parse_args()
    spec = yaml.safe_load(Path(args.claims).read_text())
    default_margin = float(spec["margin"])
    rounds = spec.get("rounds", 1)
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        print(f"check_speed: {args.claims}: rounds must be a whole number of at least 1, got {rounds!r}",
              file=sys.stderr)
        return 2
    for i, claim in enumerate(spec["claims"]):  # all of them before any bench runs
        unknown = set(claim) - CLAIM_KEYS
        if unknown:  # a misspelt `cpu_lacks` would otherwise widen a claim to CPUs it was not measured on
            print(f"check_speed: {args.claims}: claims[{i}] has unknown field(s) {', '.join(sorted(unknown))}; "
                  f"allowed: {', '.join(sorted(CLAIM_KEYS))}", file=sys.stderr)
            return 2
    from qbench.kernels import build
    machine = build.machine()
    have = set(machine["cpu_flags"])
    print(f"machine: {machine['cpu']} ({', '.join(sorted(have))}), {machine['threads']} threads; "
          f"native kernels {'built' if build.available() else 'NOT built'}")
    failed, checked = 0, 0
    for claim in spec["claims"]:
        why = not_applicable(claim, have)
        if why:
            print(f"{claim['model']}: no claim for this CPU ({why})")
            continue
        margin = float(claim.get("margin", default_margin))
        with tempfile.TemporaryDirectory(prefix="qbench-speed-") as tmp:
            variants = []
            for recipe in claim["over_fp32_engine"]:
                out = Path(tmp) / recipe
                qbench("quantize", claim["model"], "--recipe", recipe, "--out", str(out))
                variants += ["--variant", str(out)]
            report = Path(tmp) / "bench.json"
            b = int(claim["batch"])
            qbench("bench", claim["model"], "--backends", "qbench", "--batch-sizes", str(b), "--prompt-len",
                   str(claim["prompt_len"]), "--gen-len", str(claim["gen_len"]), *variants, "--rounds", str(rounds),
                   "--out", str(report))
            result = json.loads(report.read_text())
            ratios, every = result["ratios"], result.get("ratio_rounds", {})
            tok_s = {r["label"]: r["decode_tok_s"] for r in result["results"] if r["batch"] == b}
        how = "one run" if rounds == 1 else f"the median of {rounds} rounds, each ratio paired within its round"
        print(f"\n{claim['model']}, batch {b}, decode over the fp32 engine ({how}; fails below claim x "
              f"{1 - margin:.2f}):")
        print(f"fp32 engine: {tok_s.get('qbench', float('nan')):.1f} tok/s in this run")
        print("| recipe | decode tok/s | claim | measured | rounds | floor | verdict |\n|---|---|---|---|---|---|---|")
        for recipe, want in claim["over_fp32_engine"].items():
            got = ratios.get(f"qbench[{recipe}]/qbench@{b}")
            floor = want * (1 - margin)
            ok = got is not None and got >= floor
            failed += not ok
            checked += 1
            shown = "missing" if got is None else f"{got:.2f}x"
            tps = tok_s.get(f"qbench[{recipe}]", float("nan"))
            spread = ", ".join(f"{v:.2f}" for v in every.get(f"qbench[{recipe}]/qbench@{b}", [])) or "-"
            print(f"| {recipe} | {tps:.1f} | {want:.2f}x | {shown} | {spread} | {floor:.2f}x | "
                  f"{'holds' if ok else 'BELOW THE CLAIM'} |")
    print(f"\n{checked} claims checked, {failed} below their floor" if checked else "\nno claim applies here")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

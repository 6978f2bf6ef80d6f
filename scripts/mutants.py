#!/usr/bin/env python3
"""Which tests catch which bug: apply one-line bugs, one at a time, and run the tests that should fail.

    .venv/bin/python scripts/mutants.py [--only SUBSTRING] [--list]

Each mutant replaces one line of a copy of the working tree (tracked and untracked, not ignored files) and
runs its test files there with ``pytest -x``. A mutant is *caught* when some test fails, *missed* when all
pass (a gap in the suite), and *broken* when the replacement no longer matches the source (the list needs
updating). Not part of CI: it takes several minutes per mutant. Prints a markdown table; exit 1 if any
mutant is missed or broken.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]


MUTANTS = [
    Mutant("INT4 columns reversed when an artifact is loaded", "qbench/quant/artifact.py",
           'codes = unpack_int4(got[".qweight"]) if bits == 4', 'codes = unpack_int4(got[".qweight"]).flip(1) if bits == 4',
           ("tests/test_artifact.py", "tests/test_evals_kld.py", "tests/test_export.py", "tests/test_fidelity.py")),
    Mutant("INT4 nibbles packed high first", "qbench/quant/primitives.py",
           "return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)",
           "return (codes[:, 1::2] | (codes[:, 0::2] << 4)).to(torch.uint8)",
           ("tests/test_quant_primitives.py", "tests/test_fidelity.py")),
    Mutant("INT8 scale absmax / 128", "qbench/quant/primitives.py",
           "scale = (w.abs().amax(dim=1) / 127.0)", "scale = (w.abs().amax(dim=1) / 128.0)",
           ("tests/test_quant_primitives.py", "tests/test_fidelity.py")),
    Mutant("asymmetric INT4 zero point of the wrong sign", "qbench/quant/primitives.py",
           "zero = torch.clamp(torch.round(-lo / scale.float()), 0, 15)",
           "zero = torch.clamp(torch.round(lo / scale.float()), 0, 15)",
           ("tests/test_quant_primitives.py", "tests/test_fidelity.py")),
    Mutant("Wilson interval centred at p (Wald-like)", "qbench/evals/stats.py",
           "c = (p + z * z / (2 * n)) / d", "c = p",
           ("tests/test_evals_kld.py", "tests/test_stats_pinned.py")),
    Mutant("mid-p without the half probability of the observed table", "qbench/evals/stats.py",
           "return float(min(1.0, 2 * (binom.cdf(m, b + c, 0.5) - 0.5 * binom.pmf(m, b + c, 0.5))))",
           "return float(min(1.0, 2 * binom.cdf(m, b + c, 0.5)))",
           ("tests/test_evals_kld.py", "tests/test_stats_pinned.py")),
    Mutant("bootstrap resamples the two columns apart", "qbench/evals/stats.py",
           "paired=True, vectorized=True", "paired=False, vectorized=True",
           ("tests/test_evals_kld.py", "tests/test_stats_pinned.py")),
    Mutant("ln-PPL-ratio SE of the candidate alone", "qbench/evals/stats.py",
           '"ln_ppl_ratio": {"value": ln_ratio, "se": ln_se}', '"ln_ppl_ratio": {"value": ln_ratio, "se": lq_se}',
           ("tests/test_evals_kld.py", "tests/test_stats_pinned.py")),
    Mutant("MDE from a one-sided critical value", "qbench/evals/stats.py",
           "crit = binom.ppf(alpha / 2, d, 0.5) - 1", "crit = binom.ppf(alpha, d, 0.5) - 1",
           ("tests/test_mde.py",)),
    Mutant("prefill positions ignore already-cached tokens", "qbench/engine/runner.py",
           "pos.append(list(range(start, start + T)))", "pos.append(list(range(0, T)))",
           ("tests/test_rope.py", "tests/test_models_golden.py", "tests/test_engine.py",
            "tests/test_engine_positions.py")),
    Mutant("decode position one too far", "qbench/engine/runner.py",
           "positions=torch.tensor(pos, dtype=torch.int64)[:, None],  # (B, 1)",
           "positions=torch.tensor(pos, dtype=torch.int64)[:, None] + 1,  # (B, 1)",
           ("tests/test_engine.py", "tests/test_engine_positions.py")),
    Mutant("a prefix-cache hit skips one token", "qbench/engine/scheduler.py",
           "seq.block_table, seq.num_cached = list(blocks), len(blocks) * self.bm.block_size",
           "seq.block_table, seq.num_cached = list(blocks), len(blocks) * self.bm.block_size + 1",
           ("tests/test_prefix_cache.py", "tests/test_engine_positions.py")),
    Mutant("a preempted request decodes on without recomputing its cache", "qbench/engine/scheduler.py",
           "        seq.prefilled = False\n        self.waiting.appendleft(seq)",
           "        seq.prefilled = True\n        self.waiting.appendleft(seq)",
           ("tests/test_scheduler.py", "tests/test_engine_positions.py")),
    Mutant("KV min-max quantization wastes a level", "qbench/layers/kvquant.py",
           "levels = (1 << bits) - 1", "levels = (1 << bits) - 2",
           ("tests/test_kvquant.py", "tests/test_kvcache_quant.py")),
    Mutant("INT4 kernel layout drops the zero point", "qbench/quant/qlinear.py",
           "zero = q.zero if q.zero is not None else torch.full_like(q.scale, 8, dtype=torch.uint8)",
           "zero = torch.full_like(q.scale, 8, dtype=torch.uint8)",
           ("tests/test_qlinear.py",)),
    Mutant("INT4 kernel's int16 activation scale overflows at the group's absmax", "qbench/kernels/gemm_q.c",
           "float s = amax > 0.0f ? amax / 32767.0f : 1.0f, inv = 1.0f / s;",
           "float s = amax > 0.0f ? amax / 32768.0f : 1.0f, inv = 1.0f / s;",
           ("tests/test_qlinear.py",)),
]


def copy_tree(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def run_one(m: Mutant) -> tuple[str, str, float]:
    with tempfile.TemporaryDirectory(prefix="qbench-mutant-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        target = tree / m.path
        text = target.read_text()
        if text.count(m.old) != 1:
            return "broken", f"the line occurs {text.count(m.old)} times in {m.path}", 0.0
        target.write_text(text.replace(m.old, m.new))
        env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1")
        env.pop("QBENCH_REQUIRE_NATIVE", None)
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rf", *m.tests],
                           cwd=tree, env=env, capture_output=True, text=True)
        took = time.perf_counter() - t0
        where = subprocess.run([sys.executable, "-c", "import qbench; print(qbench.__file__)"], cwd=tree, env=env,
                               capture_output=True, text=True).stdout.strip()
        if not where.startswith(str(tree)):
            raise SystemExit(f"mutants: the copy's qbench is not the one imported ({where}); run from the repo's venv")
        if p.returncode == 0:
            return "missed", "all passed", took
        failed = re.findall(r"^FAILED (\S+)", p.stdout, re.M)
        if p.returncode != 1 or not failed:
            return "caught", f"pytest exit {p.returncode} (collection or crash)", took
        return "caught", failed[0].split("/")[-1], took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="run the mutants whose name contains this")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = ap.parse_args()
    chosen = [m for m in MUTANTS if args.only.lower() in m.name.lower()]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.path}; tests {', '.join(m.tests)}")
        return 0
    print("| mutant | file | verdict | first failing test | s |")
    print("|---|---|---|---|---|")
    bad = 0
    for m in chosen:
        verdict, detail, took = run_one(m)
        bad += verdict != "caught"
        print(f"| {m.name} | {m.path} | {verdict} | {detail} | {took:.0f} |", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

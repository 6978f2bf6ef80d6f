"""`qbench bench` runs every backend in one go and reports speed and memory per case."""

import json
import os
import subprocess
import sys

from conftest import SMOL


def test_bench_reports_speed_memory_and_agreement(tmp_path, smollm2):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "qbench", "bench", SMOL, "--batch-sizes", "1,2", "--prompt-len", "16",
         "--gen-len", "6", "--backends", "qbench,hf,hf-generate,nocache", "--nocache-batch-sizes", "1,2",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr
    assert "decode tok/s" in proc.stdout and "qbench/hf-generate@1" in proc.stdout
    report = json.loads(out.read_text())
    cases = {(r["backend"], r["batch"]): r for r in report["results"]}
    assert set(cases) == {(b, n) for b in ("qbench", "hf", "hf-generate", "nocache") for n in (1, 2)}
    q = cases[("qbench", 2)]
    assert q["decode_steps"] == 5 and q["decode_tok_s"] > 0 and q["prefill_tok_s"] > 0
    assert 500 * 2**20 < q["weight_bytes"] < 530 * 2**20  # fp32 SmolLM2, tied embedding counted once
    per_token = 2 * 30 * 3 * 64 * 4
    assert q["kv_bytes_per_token"] == per_token
    assert q["kv_bytes_used"] == 2 * (16 + 6 - 1) * per_token <= q["kv_bytes_reserved"]
    assert q["peak_rss_bytes"] > q["weight_bytes"]
    assert len(q["step_ms_by_quarter"]) == 4
    for key in [("qbench", 1), ("qbench", 2), ("hf-generate", 2), ("nocache", 1)]:
        assert cases[key]["greedy_match_vs_hf"] == 1.0
    assert set(report["ratios"]) >= {"qbench/hf@1", "qbench/hf-generate@2", "qbench/nocache@1"}


def test_bench_runs_quantized_variants_beside_the_fp_engine(tmp_path, smollm2):
    from qbench.quant.quantize import run_quantize
    run_quantize(SMOL, "w4g64", tmp_path / "w4g64", log=lambda s: None)
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "qbench", "bench", SMOL, "--batch-sizes", "1", "--prompt-len", "16", "--gen-len", "5",
         "--backends", "qbench", "--variant", str(tmp_path / "w4g64"), "--qlinear", "native,aten", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    labels = {r["label"]: r for r in report["results"]}
    assert set(labels) == {"qbench", "qbench[w4g64]", "qbench[w4g64/aten]"}
    assert labels["qbench[w4g64]"]["weight_bytes"] < labels["qbench"]["weight_bytes"] / 2
    assert {"qbench[w4g64]/qbench@1", "qbench[w4g64/aten]/qbench@1"} <= set(report["ratios"])


def test_bench_runs_quantized_kv_caches_beside_the_fp_cache(tmp_path, smollm2):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "qbench", "bench", SMOL, "--batch-sizes", "1", "--prompt-len", "40", "--gen-len", "5",
         "--backends", "qbench", "--kv", "kv8", "--kv", "k4v2", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    r = {x["label"]: x for x in report["results"]}
    assert set(r) == {"qbench", "qbench[kv8]", "qbench[k4v2]"}
    assert r["qbench"]["kv"]["bytes_per_token"] == 46080  # 30 layers x 2 x 3 heads x 64 x 4 bytes
    assert r["qbench[kv8]"]["kv"]["bytes_per_token"] == 13680
    assert r["qbench[k4v2]"]["kv"]["bytes_per_token"] == 6480
    assert r["qbench[kv8]"]["kv"]["fp16_bytes_per_token"] == 23040
    # the same three blocks of 16 tokens, plus one sequence's 16-token fp32 residual window
    assert r["qbench"]["kv_bytes_reserved"] == 48 * 46080
    assert r["qbench[k4v2]"]["kv_bytes_reserved"] == 48 * 6480 + 16 * 46080
    assert r["qbench[k4v2]"]["kv"]["residual_bytes_per_sequence"] == 16 * 46080
    assert {"qbench[kv8]/qbench@1", "qbench[k4v2]/qbench@1"} <= set(report["ratios"])
    assert "KV B/token" in proc.stdout and "6480 (0.28x fp16)" in proc.stdout


def test_a_case_whose_process_dies_is_reported_not_waited_on_forever():
    # llama-cpp-python built for AMX segfaults on some VMs; multiprocessing.Pool.apply would then hang
    import signal

    import pytest

    from qbench.bench.runner import CaseCrashed, run_isolated
    from qbench.kernels.build import cpu_supports, machine
    assert run_isolated(abs, -3) == 3
    with pytest.raises(TypeError):  # an exception in the case is raised in the parent
        run_isolated(abs, "x")
    with pytest.raises(CaseCrashed, match=f"signal {int(signal.SIGSEGV)}"):
        run_isolated(signal.raise_signal, signal.SIGSEGV)
    m = machine()
    assert m["threads"] >= 1 and isinstance(m["cpu_flags"], list)
    assert cpu_supports() == ({"avx2", "fma", "f16c"} <= set(m["cpu_flags"]))

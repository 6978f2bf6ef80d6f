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
    # the roofline: this machine's read bandwidth, and what each decode step reads
    bw = report["machine"]["read_bandwidth"]
    assert bw["bytes_per_s"] > 1e9 and bw["buffer_bytes"] >= 2 ** 31 and not bw["capped"]
    assert bw["last_level_cache_bytes"] > 0 and bw["buffer_bytes"] >= 8 * bw["last_level_cache_bytes"]
    assert q["peak_rss_bytes"] < bw["buffer_bytes"]  # measured in its own process: no case inherits its buffer
    assert "read bandwidth" in proc.stdout and "roofline" in proc.stdout
    roof = q["roofline"]
    assert q["decode_weight_bytes"] == q["weight_bytes"]  # tied: the head reads the table whole
    assert roof["bytes_per_step"] == int(q["weight_bytes"] + 2 * (16 + 5 / 2) * per_token)
    assert roof["ceiling_tok_s"] == 2 * bw["bytes_per_s"] / roof["bytes_per_step"]
    assert roof["fraction"] == q["decode_tok_s"] / roof["ceiling_tok_s"] and 0 < roof["fraction"] < 1.5
    assert cases[("hf", 1)]["roofline"]["kv_bytes_per_token"] == per_token
    assert "roofline" not in cases[("nocache", 1)]  # it recomputes the prompt every step: no such ceiling


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


def test_a_decode_step_reads_the_head_but_not_an_untied_embedding_table(tiny_models, tmp_path):
    import torch

    from qbench.bench.peers import hf_decode_bytes
    from qbench.bench.roofline import step_bytes
    from qbench.models.registry import load_model
    from qbench.quant.artifact import load_artifact
    from qbench.quant.quantize import run_quantize
    for family, tied in (("llama", False), ("llama-tied-bias", True)):
        folder, hf = tiny_models[family]
        m = load_model(folder, torch.float32)
        table = 128 * 64 * 4  # vocab x hidden, fp32
        assert m.decode_weight_bytes() == m.weight_bytes() - (0 if tied else table)
        hf_all = sum(t.nbytes for t in {t.untyped_storage().data_ptr(): t for t in hf.state_dict().values()}.values())
        assert hf_decode_bytes(hf) == hf_all - (0 if tied else table)
    # an INT8 embedding table of its own (Qwen's h8e8): codes and scales are left out, the INT8 head is read
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\nweights: {bits: 4, group_size: 32, lm_head: {bits: 8}, embedding: int8}\n")
    run_quantize(str(tiny_models["llama"][0]), str(recipe), tmp_path / "q", log=lambda s: None)
    q, _ = load_artifact(tmp_path / "q")
    emb = getattr(q, q.embed_attr)
    emb_bytes = sum(t.nbytes for t in [*emb.parameters(), *emb.buffers()])
    assert emb_bytes >= 128 * 64 and q.decode_weight_bytes() == q.weight_bytes() - emb_bytes
    # KV: the context grows from the prompt to prompt + gen - 1, and the residual window is per sequence
    assert step_bytes(1000, 10, batch=2, prompt_len=8, gen_len=5) == 1000 + 2 * 10 * 10
    assert step_bytes(1000, 10, 2, 8, 5, kv_bytes_per_sequence=7) == 1000 + 2 * (10 * 10 + 7)


def test_a_case_whose_process_dies_is_reported_not_waited_on_forever():
    # llama-cpp-python built for AMX segfaults on some VMs; multiprocessing.Pool.apply would then hang
    import signal

    import pytest

    from qbench.bench.isolate import CaseCrashed, run_isolated
    from qbench.kernels.build import cpu_supports, machine
    assert run_isolated(abs, -3) == 3
    with pytest.raises(TypeError):  # an exception in the case is raised in the parent
        run_isolated(abs, "x")
    with pytest.raises(CaseCrashed, match=f"signal {int(signal.SIGSEGV)}"):
        run_isolated(signal.raise_signal, signal.SIGSEGV)
    m = machine()
    assert m["threads"] >= 1 and isinstance(m["cpu_flags"], list)
    assert cpu_supports() == ({"avx2", "fma", "f16c"} <= set(m["cpu_flags"]))


def test_llama_cpps_read_per_step_comes_from_its_gguf(smollm2, qwen):
    from gguf import GGUFReader

    from qbench.bench.peers import gguf_decode_bytes
    from qbench.models.zoo import gguf_path
    for folder, tied in ((smollm2, True), (qwen, False)):
        g = gguf_path(folder)
        sizes = {t.name: int(t.n_bytes) for t in GGUFReader(str(g)).tensors}
        assert ("output.weight" not in sizes) == tied
        # tied: the table is the head, read whole; untied (Qwen, a Q8_0 head): the table is not read
        assert gguf_decode_bytes(g) == sum(sizes.values()) - (0 if tied else sizes["token_embd.weight"])
        assert gguf_decode_bytes(g) < g.stat().st_size


def test_llama_cpp_decodes_a_batch_of_sequences_in_one_call_per_step(smollm2):
    """The batched peer: B sequences, each with its own id and position, one llama_decode per step; a row's
    greedy tokens are those it gets alone (llama-cpp-python is optional: not installed, the case is skipped)."""
    import pytest

    from qbench.bench.peers import llama_cpp_available, llama_cpp_build, run_llama_cpp
    from qbench.bench.workload import bench_prompts
    from qbench.engine.api import load_tokenizer
    from qbench.models.zoo import gguf_path
    if not llama_cpp_available():
        pytest.skip("llama-cpp-python is not installed (README: the command that builds it)")
    prompts = bench_prompts(load_tokenizer(smollm2), 3, 24)
    batched = run_llama_cpp(gguf_path(smollm2), prompts, 6, 2)
    assert batched["batch"] == 3 and len(batched["decode_s"]) == 5 and all(len(t) == 6 for t in batched["tokens"])
    alone = [run_llama_cpp(gguf_path(smollm2), [p], 6, 2)["tokens"][0] for p in prompts]
    assert sum(a[:3] == b[:3] for a, b in zip(alone, batched["tokens"])) >= 2
    assert "AVX" in llama_cpp_build() or "NEON" in llama_cpp_build()


def test_a_short_run_has_one_quarter_per_step():
    # --gen-len 4 gives three decode steps: the quarters must not ask the mean of an empty slice
    from qbench.bench.runner import summarize
    out = summarize({"batch": 2, "prefill_s": 0.5, "decode_s": [0.1, 0.2, 0.3]}, 64)
    assert [round(x) for x in out["step_ms_by_quarter"]] == [100, 200, 300] and out["decode_steps"] == 3
    four = summarize({"batch": 1, "prefill_s": 0.5, "decode_s": [0.1] * 9}, 64)
    assert len(four["step_ms_by_quarter"]) == 4


def test_an_evicting_cache_reserves_its_budget_not_the_whole_context(tmp_path, smollm2):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "qbench", "bench", SMOL, "--batch-sizes", "2", "--prompt-len", "64", "--gen-len", "5",
         "--backends", "qbench", "--kv", "kv-snap", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr
    r = {x["label"]: x for x in json.loads(out.read_text())["results"]}
    block = 16 * 46080  # 16 fp32 tokens of SmolLM2
    assert r["qbench"]["kv_bytes_reserved"] == 2 * 5 * block  # 64 + 5 tokens each, whole
    # SnapKV keeps 16 of 64 prompt tokens: each sequence holds at most 2 blocks once its prefill is done, and one
    # 4-block prompt prefills at a time
    snap = r["qbench[kv-snap]"]
    assert snap["kv_bytes_reserved"] == (2 * 2 + 2) * block
    assert snap["kv_bytes_used"] == 2 * 2 * block  # 16 kept + 5 new tokens each, in 2 blocks


def test_rounds_report_the_median_round_and_pair_each_ratio_within_its_round():
    from qbench.bench.figures import combine_case, combine_ratios, ratios

    def row(label, tps, prefill, rss, tokens=((1, 2),)):
        return {"label": label, "batch": 1, "decode_tok_s": tps, "prefill_tok_s": prefill, "peak_rss_bytes": rss,
                "step_ms": {"p50": 1000 / tps}, "tokens": [list(t) for t in tokens]}
    fp = [row("qbench", 40.0, 300.0, 5), row("qbench", 20.0, 500.0, 7), row("qbench", 30.0, 100.0, 6),
          row("qbench", 50.0, 200.0, 4)]
    q = [row("qbench[w4]", 100.0, 900.0, 3), row("qbench[w4]", 50.0, 800.0, 3), row("qbench[w4]", 90.0, 700.0, 3),
         row("qbench[w4]", 160.0, 600.0, 2, tokens=((1, 3),))]
    c = combine_case(fp)
    # four rounds: the lower middle one (30 tok/s, round 3) whole, so step times and speed come from one run
    assert c["decode_tok_s"] == 30.0 and c["step_ms"]["p50"] == 1000 / 30
    assert c["prefill_tok_s"] == 200.0 and c["peak_rss_bytes"] == 7
    assert c["rounds"]["decode_tok_s"] == [40.0, 20.0, 30.0, 50.0] and c["same_tokens_every_round"]
    assert combine_case(q)["same_tokens_every_round"] is False
    assert combine_case(fp[:1]) is fp[0]  # one round: the row as it was measured
    per_round = [ratios([a, b]) for a, b in zip(fp, q)]
    med, every = combine_ratios(per_round)
    # paired within each round (2.5, 2.5, 3.0, 3.2; median 2.75), not the ratio of the two rows' medians (90 / 30)
    assert every["qbench[w4]/qbench@1"] == [2.5, 2.5, 3.0, 3.2] and med["qbench[w4]/qbench@1"] == 2.75
    assert combine_case(q)["decode_tok_s"] / c["decode_tok_s"] == 3.0
    # a ratio that a round lacks (its peer crashed there) is the median of the rounds that have it
    med, every = combine_ratios([{"a": 1.0, "b": 2.0}, {"a": 3.0}, {"a": 2.0, "b": 4.0}])
    assert med == {"a": 2.0, "b": 3.0} and every["b"] == [2.0, 4.0]


def test_a_bench_of_rounds_runs_the_cases_in_turn(smollm2):
    from qbench.bench.runner import BenchConfig, run_bench
    from qbench.bench.table import render_table
    log = []
    cfg = BenchConfig.parse(model=SMOL, batch_sizes="1", prompt_len=8, gen_len=4, backends="qbench",
                            nocache_batch_sizes="1", dtype="fp32", kv=("kv8",), rounds=2)
    report = run_bench(cfg, log=log.append)
    cases = [line for line in log if line.startswith("[")]
    assert cases == ["[1/2] (round 1/2) qbench batch 1 ...", "[2/2] (round 1/2) qbench[kv8] batch 1 ...",
                     "[1/2] (round 2/2) qbench batch 1 ...", "[2/2] (round 2/2) qbench[kv8] batch 1 ..."]
    assert sum(line.startswith("read bandwidth (round") for line in log) == 2
    r = {x["label"]: x for x in report["results"]}
    fp, kv8 = r["qbench"], r["qbench[kv8]"]
    for x in (fp, kv8):
        assert len(x["rounds"]["decode_tok_s"]) == 2 and x["same_tokens_every_round"]
        assert x["decode_tok_s"] == min(x["rounds"]["decode_tok_s"])  # the lower of two
        assert x["roofline"]["fraction"] == x["decode_tok_s"] / x["roofline"]["ceiling_tok_s"]
    pairs = [a / b for a, b in zip(kv8["rounds"]["decode_tok_s"], fp["rounds"]["decode_tok_s"])]
    assert report["ratio_rounds"]["qbench[kv8]/qbench@1"] == pairs
    assert report["ratios"]["qbench[kv8]/qbench@1"] == sum(pairs) / 2
    prefill = [a / b for a, b in zip(kv8["rounds"]["prefill_tok_s"], fp["rounds"]["prefill_tok_s"])]
    assert report["prefill_ratio_rounds"]["qbench[kv8]/qbench@1"] == prefill
    assert report["prefill_ratios"]["qbench[kv8]/qbench@1"] == sum(prefill) / 2
    bw = report["machine"]["read_bandwidth"]
    assert bw["bytes_per_s"] == max(bw["rounds_bytes_per_s"]) and len(bw["rounds_bytes_per_s"]) == 2
    text = render_table(report)
    assert "2 rounds" in text and "median of the rounds" in text and "qbench[kv8]/qbench@1" in text
    for line, p in zip(("decode speed", "prefill speed"), (pairs, prefill)):
        shown = next(t for t in text.splitlines() if t.startswith(line))
        assert f"({min(p):.2f}-{max(p):.2f})" in shown, shown


def test_rounds_below_one_or_with_a_workload_are_refused_with_one_line():
    for extra in (["--rounds", "0"], ["--rounds", "2", "--workload", "agent"]):
        p = subprocess.run([sys.executable, "-m", "qbench", "bench", SMOL, "--backends", "qbench", *extra],
                           capture_output=True, text=True, timeout=120, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        assert p.returncode == 2, p.stderr
        assert "--rounds" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr

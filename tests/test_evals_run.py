"""qbench eval: suites validated with clear errors, controlled baselines, reproducible and resumable runs."""

import json

import pytest
import torch

from conftest import SMOL, run_qbench
from qbench.errors import QBenchError
from qbench.evals.suite import load_suite

TINY = """name: tiny
seed: 7
batch_size: 3
tasks:
  kld: {data: evals/data/wikitext-2-raw/wiki.test.raw, ctx: 64, chunks: 3, top_k: 16, exact_chunks: 1}
  perplexity: {data: evals/data/wikitext-2-raw/wiki.test.raw, ctx: 64, chunks: 3, rolling_docs: 1,
               rolling_len: 256, top_k: 16, exact_chunks: 1}
"""


def suite(tmp_path, text=TINY, name="s.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


qbench = run_qbench


def strip_timings(rec):
    rec = json.loads(json.dumps(rec))
    for k in ("seconds", "task_seconds", "finished"):
        rec.pop(k, None)
    rec["tasks"].pop("speed", None)  # wall-clock measurements, by nature not reproducible
    for t in rec["tasks"].values():
        t.pop("throughput", None)
    return rec


@pytest.mark.parametrize("text, fragment", [
    ("name: x\ntasks: {kld: {}, mmlu: {}}\n", "unknown task 'mmlu'"),
    ("name: x\ntasks: {kld: {ctxx: 5}}\n", "unknown field tasks.kld.ctxx"),
    ("name: x\ntasks: {kld: {ctx: 7}}\n", "tasks.kld.ctx: 7 must be an even number"),
    ("name: x\ntasks: {kld: {chunks: -1}}\n", "tasks.kld.chunks: -1 must be an integer >= 0"),
    ("name: x\nseeed: 1\ntasks: {kld: {}}\n", "unknown field seeed"),
    ("name: x\ntasks: {}\n", "tasks must be a non-empty mapping"),
])
def test_bad_suites_name_the_file_and_field(tmp_path, text, fragment):
    path = suite(tmp_path, text)
    with pytest.raises(QBenchError) as e:
        load_suite(path)
    assert fragment in str(e.value) and path in str(e.value)


def test_the_shipped_suites_load():
    sized = {"evals/quick.yaml": "smollm2-135m-instruct", "evals/full.yaml": "qwen2.5-coder-0.5b-instruct",
             "evals/qwen.yaml": "qwen2.5-coder-0.5b-instruct"}
    for name, model in sized.items():
        s = load_suite(name)
        assert s.seed == 1234 and "kld" in s.tasks and s.sized_for == model
    full = load_suite("evals/full.yaml")
    assert full.tasks["gsm8k_cot"].limit == 0 and full.tasks["gsm8k_cot"].chat  # all 1,319 items, chat format
    n = full.tasks["needle"]
    assert len(n.lengths) >= 4 and len(n.depths) >= 5 and n.samples >= 4 and max(n.lengths) >= 16384
    q = load_suite("evals/qwen.yaml")
    assert min(q.tasks["needle"].lengths) >= 4096 and q.tasks["gsm8k_cot"].chat
    for name in ("evals/evict.yaml", "evals/evict-4k.yaml"):  # issue 18's evidence: 4k KLD windows, needle grid
        e = load_suite(name)
        assert e.tasks["kld"].ctx == 4096 and e.tasks["perplexity"].ctx == 4096 and len(e.tasks["needle"].depths) == 3
    grid, needle = load_suite("evals/evict.yaml").tasks["needle"], load_suite("evals/evict-needle.yaml").tasks["needle"]
    assert grid.lengths == [2048, 4096, 8192, 16384]
    assert (needle.lengths, needle.depths, needle.samples) == (grid.lengths, grid.depths, 1)  # its needle, one sample
    kld = load_suite("evals/evict-kld.yaml")  # evict-4k.yaml's KLD alone, under its seed and batch
    four = load_suite("evals/evict-4k.yaml")
    assert list(kld.tasks) == ["kld"] and kld.tasks["kld"] == four.tasks["kld"]
    assert (kld.seed, kld.batch_size) == (four.seed, four.batch_size)
    from qbench.evals.stats import mcnemar_mde
    assert mcnemar_mde(q.tasks["gsm8k_cot"].limit, int(0.2 * q.tasks["gsm8k_cot"].limit))["difference"] <= 0.08


def test_engine_scoring_matches_the_cache_free_forward(smollm2):
    """Teacher-forced log-probs through the engine's block cache equal one plain forward pass."""
    from qbench.evals.subject import Subject
    from qbench.layers.attention import AttnMetadata
    s = Subject(SMOL, batch_size=2)
    ids = s.encode(open("evals/data/wikitext-2-raw/wiki.test.raw").read()[:2000])[:100]
    got = s.logprobs([ids, ids[:37]])
    ref = s.engine.model(torch.tensor([ids]), AttnMetadata(positions=torch.arange(100)[None]))[0].log_softmax(-1)
    assert (got[0] - ref).abs().max() < 1e-3 and (got[1] - ref[:37]).abs().max() < 1e-3


def test_eval_runs_are_reproducible_resumable_and_batch_invariant(tmp_path, smollm2):
    s = suite(tmp_path)
    a, b = tmp_path / "a", tmp_path / "b"
    p = qbench("eval", SMOL, "--suite", s, "--out", str(a))
    assert p.returncode == 0, p.stderr
    ra = json.loads((a / "results.json").read_text())
    assert ra["suite"]["seed"] == 7 and len(ra["suite"]["hash"]) == 16 and ra["batch_size"] == 3
    assert len(ra["subject"]["weights_sha256"]) == 64 and ra["versions"]["torch"]
    assert set(ra["task_seconds"]) == set(ra["tasks"]) and sum(ra["task_seconds"].values()) <= ra["seconds"]
    seg, = ra["versions"]["code_segments"]  # one invocation computed every item and chunk
    assert seg["commit"] == ra["versions"]["qbench_commit"] and seg["computed"]["chunks"] == 3
    assert seg["machine"] == {k: ra["machine"][k] for k in ("cpu", "kernels", "aten", "threads", "torch")}
    # the same command again, from scratch: identical numbers
    assert qbench("eval", SMOL, "--suite", s, "--out", str(b)).returncode == 0
    rb = json.loads((b / "results.json").read_text())
    assert strip_timings(ra) == strip_timings(rb)
    # an interrupted run: drop the summary, a chunk and the rolling record, then resume into the folder
    (b / "results.json").unlink()
    next((b / "parts").glob("*/chunk_00001.safetensors")).unlink()
    (b / "items" / "perplexity.jsonl").write_text("{\"key\": \"doc_0")  # a line torn by Ctrl-C
    assert qbench("eval", SMOL, "--suite", s, "--out", str(b)).returncode == 0
    assert strip_timings(json.loads((b / "results.json").read_text())) == strip_timings(ra)  # code_segments too:
    assert len((b / "segments.jsonl").read_text().splitlines()) == 2  # resumed on the same commit, one segment
    # batch 1 against the suite's batch of 3: equal-length windows, so the same numbers up to float rounding
    # (the same subject as its baseline: the run reports the comparison, identical or not)
    c = tmp_path / "c"
    p = qbench("eval", SMOL, "--suite", s, "--out", str(c), "--batch-size", "1", "--baseline", str(a))
    assert p.returncode == 0, p.stderr
    rc = json.loads((c / "results.json").read_text())
    inv = rc["batch_invariance"]
    assert inv["batch_sizes"] == [3, 1] and "batch invariance (batch 1 vs 3)" in p.stdout
    for task in ("kld", "perplexity"):
        x, y = inv["tasks"][task]["score"]
        assert x == pytest.approx(y, rel=1e-5) and x == (ra["tasks"][task]["score"] if task == "perplexity"
                                                         else ra["tasks"][task]["own"]["ppl"])
    assert inv["chunks"]["compared"] == 3  # kld and perplexity share their chunks
    assert inv["chunks"]["max_abs_difference"] < 1e-3
    assert inv["identical"] == (inv["chunks"]["differing"] == 0 and inv["tasks"]["perplexity"]["items"]["differing"] == 0)
    assert rc["tasks"]["kld"]["kld"]["max"] < 1e-4  # the model against itself at another batch size
    # a candidate against the baseline: the KV-quantized cache, scored on exactly the baseline's tokens
    d = tmp_path / "d"
    p = qbench("eval", SMOL, "--suite", s, "--out", str(d), "--baseline", str(a), "--kv", "kv4")
    assert p.returncode == 0, p.stderr
    k = json.loads((d / "results.json").read_text())["tasks"]["kld"]
    assert k["tokens"] == 3 * 31 and 0 < k["kld"]["mean"] < 0.1 and k["same_top_p"]["mean"] > 0.8
    assert k["top_k_check"]["top_k_mean"] <= k["top_k_check"]["full_vocabulary_mean"] + 1e-6
    assert "kld: mean" in p.stdout
    # the fp model against itself: zero divergence
    e = tmp_path / "e"
    assert qbench("eval", SMOL, "--suite", s, "--out", str(e), "--baseline", str(a)).returncode == 0
    k = json.loads((e / "results.json").read_text())["tasks"]["kld"]
    assert k["kld"]["max"] < 1e-5 and k["same_top_p"]["mean"] == 1.0


def test_baseline_from_another_suite_or_seed_is_refused(tmp_path, smollm2):
    s = suite(tmp_path)
    a = tmp_path / "a"
    other = suite(tmp_path, TINY.replace("seed: 7", "seed: 8"), "other.yaml")
    (a).mkdir()
    (a / "results.json").write_text(json.dumps({"suite": {"name": "tiny", "hash": load_suite(other).hash, "seed": 8},
                                                    "subject": {}, "tasks": {}}))
    p = qbench("eval", SMOL, "--suite", s, "--out", str(tmp_path / "c"), "--baseline", str(a))
    assert p.returncode == 2 and "the baseline was made under suite 'tiny'" in p.stderr and "seed 8" in p.stderr
    assert not (tmp_path / "c").exists()
    p = qbench("eval", SMOL, "--suite", s, "--out", str(tmp_path / "c"), "--baseline", str(tmp_path / "nope"))
    assert p.returncode == 2 and "not a finished qbench eval run" in p.stderr


def test_missing_or_malformed_data_is_named(tmp_path, smollm2):
    s = suite(tmp_path, TINY.replace("evals/data/wikitext-2-raw/wiki.test.raw", "nowhere/wiki.raw"))
    p = qbench("eval", SMOL, "--suite", s, "--out", str(tmp_path / "r"))
    assert p.returncode == 2 and "tasks.kld.data: data file nowhere/wiki.raw not found" in p.stderr
    assert len([ln for ln in p.stderr.splitlines() if ln.strip()]) == 1 and not (tmp_path / "r").exists()
    from qbench.evals.data import DataError, load_jsonl
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a", "answer": "b"}\n{"question": oops}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        load_jsonl(str(bad), "suite.yaml: tasks.gsm8k.data")
    with pytest.raises(DataError, match=r"bad.jsonl:1: missing field 'target'"):
        load_jsonl(str(bad), "w", required=("target",))


PREFIX_SUITE = """
name: prefix
seed: 3
batch_size: 4
tasks:
  needle: {kinds: [niah_single_essay, niah_multikey], lengths: [256, 512], depths: [25, 100], max_new_tokens: 12}
  gsm8k_cot: {limit: 3, max_new_tokens: 12}
"""


def test_evals_give_identical_records_with_and_without_the_prefix_cache(tmp_path, smollm2):
    s = suite(tmp_path, PREFIX_SUITE)
    off, on = tmp_path / "off", tmp_path / "on"
    p = qbench("eval", SMOL, "--suite", s, "--out", str(off), "--no-prefix-cache")
    assert p.returncode == 0, p.stderr
    p = qbench("eval", SMOL, "--suite", s, "--out", str(on), "--baseline", str(off))
    assert p.returncode == 0, p.stderr
    r_off, r_on = (json.loads((d / "results.json").read_text()) for d in (off, on))
    assert r_off["prefix_cache"] is False and r_on["prefix_cache"] is True
    inv = r_on["batch_invariance"]
    assert inv["identical"] and inv["prefix_cache"] == [False, True]
    assert "prefix cache on vs batch 4, prefix cache off): identical" in p.stdout
    for task in ("needle", "gsm8k_cot"):
        a, b = r_off["tasks"][task]["throughput"], r_on["tasks"][task]["throughput"]
        assert a["prefill_tokens_from_cache"] == 0
        # the 8-shot exemplars and the haystack before the first needle were computed once
        assert b["prefill_tokens_from_cache"] > 0.1 * a["prefill_tokens_computed"]
        assert b["prefill_tokens_computed"] + b["prefill_tokens_from_cache"] == a["prefill_tokens_computed"]
    assert r_on["tasks"]["gsm8k_cot"]["throughput"]["prefill_saved_fraction"] > 0.5

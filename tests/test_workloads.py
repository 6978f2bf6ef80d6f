"""qbench bench --workload: GSM8K replay with and without the prefix cache, the 20-step agent, and a mixed
stream under static and continuous batching at block sizes 8, 16 and 32."""

import json

import pytest

from conftest import SMOL, run_qbench
from qbench.bench import workloads as w


@pytest.fixture(scope="module")
def subject(smollm2):
    return w.Subject(SMOL)


def test_gsm8k_workload_replays_the_eval_and_saves_the_shared_prefix(smollm2, tmp_path):
    out = tmp_path / "gsm8k.json"
    r = run_qbench("bench", SMOL, "--workload", "gsm8k", "--limit", 3, "--gen-len", 8, "--out", out)
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    off, on = rep["without_cache"], rep["with_cache"]
    assert rep["task"] == "gsm8k_cot" and rep["items"] == 3 and rep["identical_outputs"] is True
    assert off["prefill_tokens_computed"] == rep["prompt_tokens"] and off["prefill_tokens_from_cache"] == 0
    # the 8-shot prefix (about 700 tokens) is computed once, not three times
    assert on["prefill_tokens_from_cache"] >= 2 * 640
    assert on["prefill_tokens_computed"] + on["prefill_tokens_from_cache"] == off["prefill_tokens_computed"]
    assert rep["prefill_tokens_saved_fraction"] == pytest.approx(on["prefill_tokens_from_cache"] / rep["prompt_tokens"])
    assert on["wall_s"] > 0 and off["wall_s"] > 0
    assert "saved" in r.stdout and "identical outputs: True" in r.stdout


def test_agent_prefill_is_quadratic_without_the_cache_and_linear_with_it(subject):
    rep = w.agent(subject, steps=8, gen_len=4)
    off, on = rep["without_cache"], rep["with_cache"]
    assert rep["identical_outputs"] is True
    per = off["prefill_tokens_per_step"]
    assert all(b > a for a, b in zip(per, per[1:])) and off["total_growth"] == "quadratic"
    assert per[0] == rep["system_tokens"] and per[-1] < off["final_history_tokens"]  # the whole history, each step
    # with the cache each step computes its new tokens plus at most one partial block of the last
    grown = [b - a for a, b in zip(per, per[1:])]
    assert all(n <= g + 16 for n, g in zip(on["prefill_tokens_per_step"][1:], grown))
    assert on["total_growth"] == "linear" and on["prefill_tokens_total"] < off["prefill_tokens_total"] / 2


def test_mixed_stream_static_vs_continuous_and_block_sizes(subject):
    rep = w.mixed(subject, requests_n=8, max_batch=4, token_budget=256, max_prompt=128, max_gen=24)
    st, co = rep["static"], rep["continuous"]
    assert rep["identical_outputs"] is True
    assert st["generated_tokens"] == co["generated_tokens"] == sum(rep["gen_tokens"])
    for r in (st, co):
        assert r["latency_s"]["p50"] <= r["latency_s"]["p90"] <= r["latency_s"]["p99"] <= r["wall_s"]
        assert r["throughput_tok_s"] > 0
    # static batching reserves each request's whole budget up front; continuous grows block by block
    assert st["memory"]["reserved_over_used"] > co["memory"]["reserved_over_used"]
    assert co["memory"]["steps"] < st["memory"]["steps"]
    sizes = {m["block_size"]: m for m in rep["block_sizes"]}
    assert set(sizes) == {8, 16, 32}
    for bs, m in sizes.items():
        assert m["identical_outputs"] and m["waste_within_one_partial_block"]
        assert m["max_waste_tokens_per_sequence"] <= bs - 1
        assert m["peak_reserved_bytes"] >= m["used_bytes_at_peak"]
    # smaller blocks waste less and index more
    assert sizes[8]["reserved_over_used"] <= sizes[16]["reserved_over_used"] <= sizes[32]["reserved_over_used"]
    assert sizes[8]["block_table_entries"] > sizes[16]["block_table_entries"] > sizes[32]["block_table_entries"]


def test_unknown_workload_is_refused(smollm2):
    r = run_qbench("bench", SMOL, "--workload", "chat")
    assert r.returncode != 0 and "chat" in r.stderr


def test_generate_n_samples_share_the_prompt_blocks(smollm2):
    r = run_qbench("generate", SMOL, "Tell me about the sea. " * 6, "-n", 4, "--temperature", 0.9,
                   "--max-new-tokens", 12, "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(rows) == 4 and len({tuple(x["tokens"]) for x in rows}) > 1  # four different samples
    line = next(x for x in r.stderr.splitlines() if "samples share" in x)
    peak, alone = (int(x) for x in __import__("re").findall(r"(\d+) (?:blocks|unshared)", line)[:2])
    assert peak < alone and "3 copy-on-write copies" in line  # the fourth writer owned the block alone

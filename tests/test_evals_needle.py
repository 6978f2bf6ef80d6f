"""Needle retrieval: prompts built to length with needles at their depths, RULER's scoring, heatmaps."""

import json
import random

import pytest

from conftest import SMOL, run_qbench
from qbench.errors import QBenchError
from qbench.evals import needle as nd
from qbench.evals.data import load_text
from qbench.evals.suite import load_suite


def count(s, memo=True):  # a whitespace "tokenizer" is enough to check the arithmetic
    return len(s.split())


@pytest.mark.parametrize("kind", nd.KINDS)
@pytest.mark.parametrize("depth", [0, 50, 100])
def test_items_have_their_needles_at_the_depth_and_fit_the_length(kind, depth):
    essay = nd.essay_sentences(load_text(nd.Config.haystack, "t"))
    assert not any("Gutenberg" in s for s in essay[:50] + essay[-50:])  # the licence text is cut off
    item = nd.build_item(kind, 600, depth, random.Random(1), essay, count, nd.Config())
    again = nd.build_item(kind, 600, depth, random.Random(1), essay, count, nd.Config())
    assert item == again  # seeded
    assert 0.9 * 600 <= count(item["prompt"]) <= 600  # filled to within one sentence
    n_values = 3 if kind == "niah_multivalue" else 1
    assert len(item["expected"]) == n_values and all(len(v) == 7 and v.isdigit() for v in item["expected"])
    ctx = item["prompt"].split("\n")[1]
    first = ctx.find(nd.NEEDLE.format(key=item["key"], value=item["expected"][0]))
    assert first >= 0 and abs(first / len(ctx) - depth / 100) < 0.15  # sentence granularity, other needles
    if kind == "niah_multikey":
        assert ctx.count("One of the special magic numbers for") == 4
    if kind == "niah_single_noise":
        assert "The grass is green." in ctx


def test_string_match_all():
    assert nd.string_match_all("It is 1234567 and 7654321.", ["1234567", "7654321"]) == 1.0
    assert nd.string_match_all("It is 1234567.", ["1234567", "7654321"]) == 0.5
    assert nd.string_match_all("nothing", ["1234567"]) == 0.0


def test_bad_needle_settings_are_named(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("name: x\ntasks: {needle: {kinds: [niah_tracing]}}\n")
    with pytest.raises(QBenchError, match=r"tasks.needle.kinds: 'niah_tracing' is not one of"):
        load_suite(str(p))
    p.write_text("name: x\ntasks: {needle: {depths: [0, 120]}}\n")
    with pytest.raises(QBenchError, match=r"tasks.needle.depths"):
        load_suite(str(p))


def test_needle_grid_heatmaps_and_paired_scores(tmp_path, smollm2):
    suite = tmp_path / "s.yaml"
    suite.write_text("name: n\nseed: 5\nbatch_size: 4\ntasks:\n  needle: {kinds: [niah_single_noise, niah_multikey], "
                     "lengths: [200, 400], depths: [0, 100], max_new_tokens: 12}\n")
    run = lambda *a: run_qbench("eval", SMOL, "--suite", suite, *a)  # noqa: E731
    assert run("--out", str(tmp_path / "a")).returncode == 0
    p = run("--out", str(tmp_path / "b"), "--baseline", str(tmp_path / "a"), "--kv", "k4v2")
    assert p.returncode == 0, p.stderr
    n = json.loads((tmp_path / "b" / "results.json").read_text())["tasks"]["needle"]
    assert n["items"] == 8 and len(n["kinds"]["niah_multikey"]["grid"]) == 2 and set(n["by_length"]) == {"200", "400"}
    assert "p_value" in n["vs_baseline"]["mcnemar"]
    png = (tmp_path / "b" / "needle_niah_multikey.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    big = tmp_path / "big.yaml"
    big.write_text("name: n\ntasks:\n  needle: {lengths: [8190]}\n")
    p = run_qbench("eval", SMOL, "--suite", big, "--out", tmp_path / "c")
    assert p.returncode == 2 and "exceed the model's context window of 8192" in p.stderr

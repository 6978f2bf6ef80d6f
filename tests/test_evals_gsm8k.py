"""GSM8K: lm-eval's prompt formats, filters and exact-match rules, seeded subsets, paired records."""

import json

import pytest
import yaml

from conftest import SMOL, run_qbench
from qbench.evals import gsm8k as g
from qbench.evals.data import load_jsonl


def test_filters_and_rules_are_lm_evals():
    ref = yaml.safe_load(open("evals/data/reference/gsm8k-cot.yaml"))
    filters = {f["name"]: f["filter"][0] for f in ref["filter_list"]}
    assert filters["strict-match"]["regex_pattern"] == g.FORMATS["gsm8k_cot"]["strict"]
    assert filters["flexible-extract"]["regex_pattern"] == g.FLEXIBLE and filters["flexible-extract"]["group_select"] == -1
    assert tuple(ref["metric_list"][0]["regexes_to_ignore"]) == g.IGNORE and ref["metric_list"][0]["ignore_case"]
    assert tuple(ref["generation_kwargs"]["until"]) == g.FORMATS["gsm8k_cot"]["stop"]
    assert ref["doc_to_text"] == g.FORMATS["gsm8k_cot"]["text"].replace("{q}", "{{question}}")
    assert len(g.cot_exemplars()) == 8 == ref["num_fewshot"]


@pytest.mark.parametrize("fmt, output, target, strict, flexible", [
    ("gsm8k", "She makes 9 * 2 = $18.\n#### 18", "18", True, True),
    ("gsm8k", "#### 1,000\n\nQuestion", "1000", True, True),
    ("gsm8k", "The total is 18 dollars", "18", False, True),
    ("gsm8k_cot", "9 * 2 = 18. The answer is 18.", "18", True, True),
    ("gsm8k_cot", "The answer is $18.", "18", False, True),  # strict's pattern has no "$"
    ("gsm8k_cot", "So 5 + 4 = 9 toys and 10 more", "9", False, False),  # flexible takes the last number
    ("gsm8k_cot", "nothing numeric", "9", False, False),
])
def test_scoring_examples(fmt, output, target, strict, flexible):
    s = g.score(output, target, fmt)
    assert (s["strict_correct"], s["flexible_correct"]) == (strict, flexible), s
    if output == "nothing numeric":
        assert s["strict"] == s["flexible"] == "[invalid]"


def test_prompts_and_seeded_subsets():
    rows = load_jsonl("evals/data/gsm8k/test.jsonl", "t", required=("question", "answer"))
    assert len(rows) == 1319 and g.target_of(rows[0]) == "18"
    assert g.select(1319, 10, 1234) == g.select(1319, 10, 1234) != g.select(1319, 10, 1235)
    assert len(set(g.select(1319, 10, 1234))) == 10
    cot = g.build_prompt(g.CotConfig(), rows[0], g.cot_exemplars())
    assert cot.startswith("Q: There are 15 trees") and cot.endswith("Q: " + rows[0]["question"] + "\nA:")
    assert cot.count("\n\nQ: ") == 8
    five = g.build_prompt(g.Config(), rows[0], rows[1:6])
    assert five.count("####") == 5 and five.endswith("Question: " + rows[0]["question"] + "\nAnswer:")


def test_gsm8k_runs_paired_against_its_baseline(tmp_path, smollm2):
    suite = tmp_path / "s.yaml"
    suite.write_text("name: g\nseed: 3\nbatch_size: 2\ntasks:\n  gsm8k: {limit: 2, max_new_tokens: 48}\n"
                     "  gsm8k_cot: {limit: 2, max_new_tokens: 48}\n")
    run = lambda *a: run_qbench("eval", SMOL, "--suite", suite, *a)  # noqa: E731
    p = run("--out", str(tmp_path / "a"))
    assert p.returncode == 0, p.stderr
    p = run("--out", str(tmp_path / "b"), "--baseline", str(tmp_path / "a"), "--kv", "kv8")
    assert p.returncode == 0, p.stderr
    res = json.loads((tmp_path / "b" / "results.json").read_text())["tasks"]
    for task in ("gsm8k", "gsm8k_cot"):
        t = res[task]
        assert t["items"] == 2 and 0 <= t["strict"]["ci95"][0] <= t["strict"]["accuracy"] <= t["strict"]["ci95"][1]
        assert t["vs_baseline"]["same_prompts"] and "p_value" in t["vs_baseline"]["strict"]["mcnemar"]
        recs = [json.loads(x) for x in (tmp_path / "b" / "items" / f"{task}.jsonl").read_text().splitlines()]
        assert {"prompt", "output", "strict", "flexible", "target"} <= set(recs[0])
        assert all(r["generated_tokens"] <= 48 for r in recs)


def test_first_divergence():
    from qbench.evals.custom import first_divergence
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_the_users_own_prompts_compared_with_the_baseline(tmp_path, smollm2):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Name a color."}\n{"prompt": "Count to five."}\n{"id": "x", "prompt": "Say hi."}\n')
    suite = tmp_path / "s.yaml"
    suite.write_text(f"name: c\nseed: 1\nbatch_size: 3\ntasks:\n  custom: {{data: {prompts}, max_new_tokens: 12}}\n")
    run = lambda *a: run_qbench("eval", SMOL, "--suite", suite, *a)  # noqa: E731
    assert run("--out", str(tmp_path / "a")).returncode == 0
    p = run("--out", str(tmp_path / "b"), "--baseline", str(tmp_path / "a"))
    assert p.returncode == 0, p.stderr
    c = json.loads((tmp_path / "b" / "results.json").read_text())["tasks"]["custom"]
    assert c["exact_match"] == 1.0 and c["first_divergence"]["median"] == 12  # the fp model against itself
    p = run("--out", str(tmp_path / "c"), "--baseline", str(tmp_path / "a"), "--kv", "k4v2")
    c = json.loads((tmp_path / "c" / "results.json").read_text())["tasks"]["custom"]
    assert 0 <= c["exact_match"] <= 1 and len(c["first_divergence"]["positions"]) == 3
    assert (tmp_path / "c" / "custom_divergence.png").read_bytes()[:4] == b"\x89PNG"

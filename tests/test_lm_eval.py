"""qbench as an lm-eval model: scoring checked against transformers, and lm-eval's GSM8K checked
item by item against qbench's own GSM8K eval on the same items."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import SMOL

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from qbench.evals import gsm8k as g  # noqa: E402

TASKS = "evals/lm_eval_tasks"


@pytest.fixture(scope="module")
def lm(smollm2):
    from qbench.evals.lm_eval_model import QBenchLM
    return QBenchLM(pretrained=SMOL, batch_size=3)


@pytest.fixture(scope="module")
def hf(smollm2):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32).eval()


def _hf_logprob(hf, inp: list[int], targets: list[int]) -> float:
    """The golden path: transformers' full-vocabulary log-softmax, the targets' log-probs summed."""
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([inp])).logits[0].double(), -1)
    tail = lp[len(inp) - len(targets):]
    return tail.gather(1, torch.tensor(targets)[:, None]).sum().item()


def _req(kind, *args):
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def test_the_model_is_registered_by_name_without_importing_it():
    code = ("import sys, lm_eval.api.registry as r; cls = r.get_model('qbench'); "
            "print(cls.__module__, 'hf' in r.model_registry)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["qbench.evals.lm_eval_model", "True"]  # lm-eval's own models are still there


def test_loglikelihood_matches_transformers(lm, hf):
    pairs = [("The capital of France is", " Paris"), ("2 + 2 = ", "4, and 3 + 3 = 6"),
             ("Question: what colour is the sky?\nAnswer:", " Blue."), ("", "Hello world")]
    got = lm.loglikelihood([_req("loglikelihood", *p) for p in pairs], disable_tqdm=True)
    for (ctx, cont), (logp, greedy) in zip(pairs, got):
        if ctx:
            c, x = lm._encode_pair(ctx, cont)
        else:
            c, x = [lm.prefix_token_id], lm.tok_encode(cont)
        assert logp == pytest.approx(_hf_logprob(hf, (c + x)[:-1], x), abs=2e-3), (ctx, cont)
        assert isinstance(greedy, bool)
    assert got[0][1]  # " Paris" is the model's greedy continuation


def test_loglikelihood_rolling_matches_transformers_window_by_window(hf, smollm2):
    from qbench.evals.lm_eval_model import QBenchLM
    text = open("evals/data/wikitext-2-raw/wiki.test.raw", encoding="utf-8").read()[:1500]
    for max_length in (8192, 96):  # one window, then several
        lm = QBenchLM(pretrained=SMOL, batch_size=2, max_length=max_length)
        got = lm.loglikelihood_rolling([_req("loglikelihood_rolling", text)], disable_tqdm=True)[0]
        toks = lm.tok_encode(text)
        windows = [make_disjoint_window(w) for w in get_rolling_token_windows(toks, lm.prefix_token_id, max_length, 1)]
        assert (len(windows) == 1) == (max_length == 8192) and sum(len(w[1]) for w in windows) == len(toks)
        want = sum(_hf_logprob(hf, (c + x)[:-1], x) for c, x in windows)
        assert got == pytest.approx(want, abs=1e-2 + 2e-5 * abs(want))


def test_generate_until_cuts_at_the_stop_strings(lm):
    out = lm.generate_until([_req("generate_until", "Count: one, two, three,", {"until": [","], "max_gen_toks": 8}),
                             _req("generate_until", "Say hi.", {"until": ["\n"], "max_gen_toks": 3})],
                            disable_tqdm=True)
    assert out[0] == " four" and "\n" not in out[1]
    with pytest.raises(Exception, match="does not support"):
        lm.generate_until([_req("generate_until", "x", {"until": [], "num_beams": 4})], disable_tqdm=True)


def _suite(tmp_path, n: int, max_new: int, chat: bool = False):
    suite = tmp_path / "suite.yaml"
    suite.write_text(f"name: l\nseed: 5\nbatch_size: 4\ntasks:\n  gsm8k_cot: {{limit: {n}, max_new_tokens: {max_new}, "
                     f"chat: {str(chat).lower()}}}\n")
    return suite


def _lm_eval_gsm8k(indices: list[int], max_new: int, batch_size: int = 4, chat: bool = False) -> tuple[dict, list[dict]]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    res = simple_evaluate(model="qbench", model_args={"pretrained": SMOL}, tasks=["gsm8k_cot_local"],
                          task_manager=TaskManager(include_path=TASKS), samples={"gsm8k_cot_local": indices},
                          batch_size=batch_size, gen_kwargs={"max_gen_toks": max_new}, log_samples=True,
                          apply_chat_template=chat, fewshot_as_multiturn=chat)
    return res["results"]["gsm8k_cot_local"], res["samples"]["gsm8k_cot_local"]


def _compare(ours: list[dict], theirs: list[dict], summary: dict, ours_summary: dict) -> None:
    by_doc = {s["doc_id"]: s for s in theirs if s["filter"] == "strict-match"}
    assert sorted(by_doc) == sorted(r["index"] for r in ours)
    for r in ours:
        s = by_doc[r["index"]]
        assert s["arguments"][0][0] == r["prompt"]  # the same prompt, byte for byte
        assert s["resps"][0][0].strip() == r["output"].strip()  # the same greedy generation
        strict = [x for x in theirs if x["filter"] == "strict-match" and x["doc_id"] == r["index"]][0]
        flexible = [x for x in theirs if x["filter"] == "flexible-extract" and x["doc_id"] == r["index"]][0]
        assert strict["filtered_resps"][0] == r["strict"] and strict["exact_match"] == r["strict_correct"]
        assert flexible["filtered_resps"][0] == r["flexible"] and flexible["exact_match"] == r["flexible_correct"]
    assert summary["exact_match,strict-match"] == ours_summary["strict"]["accuracy"]
    assert summary["exact_match,flexible-extract"] == ours_summary["flexible"]["accuracy"]


def _ours(tmp_path, n, max_new, chat=False):
    from qbench.evals.run import run_eval
    rec = run_eval(SMOL, str(_suite(tmp_path, n, max_new, chat)), tmp_path / "run", log=lambda m: None)
    items = [json.loads(x) for x in (tmp_path / "run" / "items" / "gsm8k_cot.jsonl").read_text().splitlines()]
    return rec["tasks"]["gsm8k_cot"], items


def test_lm_evals_gsm8k_equals_qbenchs_own_on_the_same_items(tmp_path, smollm2):
    summary_ours, items = _ours(tmp_path, 4, 64)
    summary, samples = _lm_eval_gsm8k(sorted(r["index"] for r in items), 64)
    _compare(items, samples, summary, summary_ours)


def test_the_chat_format_equals_lm_evals_apply_chat_template_with_fewshot_as_multiturn(tmp_path, smollm2):
    """An instruct model is asked in its chat format: the 8 exemplars as user/assistant turns. The rendered
    prompts, the generations and the scores must equal lm-eval's --apply_chat_template --fewshot_as_multiturn."""
    summary_ours, items = _ours(tmp_path, 3, 48, chat=True)
    assert summary_ours["prompt_format"] == "chat template, few-shot as multi-turn"
    first = items[0]["prompt"]
    assert first.count("<|im_start|>user") == 9 and first.count("<|im_start|>assistant") == 9  # 8 shots + the item
    assert first.endswith("<|im_start|>assistant\n") and "\n\nQ:" not in first
    summary, samples = _lm_eval_gsm8k(sorted(r["index"] for r in items), 48, chat=True)
    _compare(items, samples, summary, summary_ours)


def test_the_scores_agree_when_answers_are_right_and_wrong(tmp_path, smollm2, monkeypatch):
    """SmolLM2-135M solves almost no GSM8K item, so equal scores could be 0 == 0. Here the engine's
    generations are replaced by canned answers in both pipelines: right, right but "$"-formatted
    (flexible only), no number, and wrong, a quarter each; lm-eval's scores must equal qbench's."""
    from qbench.engine.api import load_tokenizer
    from qbench.engine.engine import Engine
    from qbench.evals.data import load_jsonl
    rows = load_jsonl("evals/data/gsm8k/test.jsonl", "t", required=("question", "answer"))
    tok = load_tokenizer(smollm2)
    by_question = {r["question"]: (i, g.target_of(r)) for i, r in enumerate(rows)}
    rank = {i: r for r, i in enumerate(g.select(len(rows), 12, 5))}  # the suite's seeded subset (seed 5)

    def canned(self, prompts, params):
        out = []
        for ids in prompts:
            question = tok.decode(ids).rsplit("Q: ", 1)[1].rsplit("\nA:", 1)[0]
            i, gold = by_question[question]
            text = [f" So it is {gold}. The answer is {gold}.", f" The answer is ${gold}.", " I do not know.",
                    f" It is {int(gold.replace(',', '')) + 1}. The answer is {int(gold.replace(',', '')) + 1}."][rank[i] % 4]
            out.append(SimpleNamespace(text=text, output_ids=tok(text)["input_ids"], finish_reason="stop"))
        return out

    monkeypatch.setattr(Engine, "generate", canned)
    summary_ours, items = _ours(tmp_path, 12, 32)
    assert (summary_ours["strict"]["accuracy"], summary_ours["flexible"]["accuracy"]) == (0.25, 0.5)
    summary, samples = _lm_eval_gsm8k(sorted(r["index"] for r in items), 32)
    _compare(items, samples, summary, summary_ours)


def test_the_lm_eval_command_runs_on_the_shipped_data(tmp_path, smollm2):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    tasks = os.path.abspath(TASKS)
    p = subprocess.run([os.path.join(os.path.dirname(sys.executable), "lm_eval"),
                        "--model", "qbench", "--model_args", f"pretrained={SMOL}", "--include_path", tasks,
                        "--tasks", "gsm8k_local", "--limit", "2", "--gen_kwargs", "max_gen_toks=16",
                        "--output_path", str(tmp_path / "out")], capture_output=True, text=True, timeout=600, env=env,
                       cwd="/")  # the task finds its data from its own folder, wherever lm_eval runs
    assert p.returncode == 0, p.stderr[-3000:]
    assert "gsm8k_local" in p.stdout and "strict-match" in p.stdout

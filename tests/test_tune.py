"""qbench sensitivity and qbench tune: the search's arithmetic against brute force, the replayed measurement
against a whole-model forward of a really quantized copy, and the files they write (or refuse to)."""

import itertools
import json

import pytest
import torch

from conftest import FAMILIES, run_qbench
from qbench.errors import QBenchError
from qbench.layers.attention import AttnMetadata
from qbench.models.registry import load_model
from qbench.quant.apply import quantize_model
from qbench.quant.recipe import load_recipe, recipe_from_dict
from qbench.tune import search
from qbench.tune.reference import Reference
from qbench.tune.sensitivity import Scheme, measure, parse_scheme, parse_schemes, units
from qbench.tune.tune import Budget, recipe_for


class CharTokenizer:
    """A stand-in for the tiny models, whose folders hold no tokenizer: one id per character, within 128."""

    def __call__(self, text):
        return {"input_ids": [2 + ord(c) % 120 for c in text[:40000]]}


@pytest.fixture
def char_tokenizer(monkeypatch):
    monkeypatch.setattr("qbench.engine.api.load_tokenizer", lambda folder: CharTokenizer())


def test_scheme_names_parse_and_bad_ones_get_one_line():
    assert parse_scheme("w4g64") == Scheme("w4g64", 4, 64, True)
    assert parse_scheme("w4g128-asym") == Scheme("w4g128-asym", 4, 128, False)
    assert parse_scheme("w8") == Scheme("w8", 8, None, True) and parse_scheme("fp").fp
    for bad, msg in [("w4", "needs a group size"), ("w4g96", "needs a group size"), ("w8g64", "write w8"),
                     ("int4", "not a scheme name"), ("w3g64", "not a scheme name")]:
        with pytest.raises(QBenchError, match=msg):
            parse_scheme(bad)
    with pytest.raises(QBenchError, match="names a scheme twice"):
        parse_schemes("w8,w8")


def _rows(costs: list[list[float]], sizes: list[list[int]], names: list[str]) -> list[dict]:
    return [{"unit": f"u{i}", "bytes": dict(zip(names, b)), "kld": {n: {"mean": c_, "se": 0.0} for n, c_ in zip(names, c)}}
            for i, (c, b) in enumerate(zip(costs, sizes))]


def _brute(rows, names, target):
    best = None
    for combo in itertools.product(names, repeat=len(rows)):
        ch = {r["unit"]: s for r, s in zip(rows, combo)}
        if search.predicted(rows, ch, "kld") <= target:
            b = search.total_bytes(rows, ch, 0)
            best = b if best is None else min(best, b)
    return best


def test_greedy_fits_the_target_and_matches_brute_force_where_gains_per_byte_fall():
    names = ["w4", "w6", "w8"]
    # per unit, each extra byte buys less than the one before (a convex trade-off), the case greedy solves exactly
    rows = _rows([[0.9, 0.3, 0.1], [0.2, 0.08, 0.05], [0.5, 0.1, 0.02], [0.05, 0.03, 0.02]],
                 [[10, 15, 20]] * 4, names)
    for target in (0.205, 0.255, 0.355, 0.505, 0.805, 1.205, 2.0):
        ch = search.greedy(rows, names, target)
        assert search.predicted(rows, ch, "kld") <= target + 1e-12
        assert search.total_bytes(rows, ch, 0) == _brute(rows, names, target), target
    # no mix fits: the most accurate one
    assert search.greedy(rows, names, 0.01) == {r["unit"]: "w8" for r in rows}
    # ties in bytes go to the lower loss; a fitting target leaves the cheapest schemes
    assert search.greedy(rows, names, 10.0) == {r["unit"]: "w4" for r in rows}


def test_greedy_gives_back_bytes_and_stays_monotone_in_the_target():
    g = torch.Generator().manual_seed(0)
    names = ["a", "b", "c", "d"]
    for trial in range(20):
        costs = torch.rand(6, 4, generator=g).sort(dim=1, descending=True).values.tolist()
        sizes = (torch.rand(6, 4, generator=g) * 10 + 1).cumsum(1).round().int().tolist()
        rows = _rows(costs, sizes, names)
        for target in sorted(torch.rand(5, generator=g).mul(sum(c[0] for c in costs)).tolist()):
            ch = search.greedy(rows, names, target)
            ok = search.predicted(rows, ch, "kld") <= target + 1e-12
            assert ok or ch == {r["unit"]: "d" for r in rows}
            b = search.total_bytes(rows, ch, 0)
            opt = _brute(rows, names, target)
            assert opt is None or b >= opt  # never better than the optimum: the arithmetic is honest
            # and no single unit can step down to a cheaper scheme while the prediction stays within the target
            for r in rows:
                for s in names:
                    if r["bytes"][s] < r["bytes"][ch[r["unit"]]] and ok:
                        alt = dict(ch, **{r["unit"]: s})
                        assert search.predicted(rows, alt, "kld") > target


def test_frontier_keeps_the_points_nothing_beats():
    pts = [{"name": n, "bytes": b, "loss": l} for n, b, l in
           [("w4g128", 100, 0.5), ("w4g64", 104, 0.4), ("w4g128-asym", 104, 0.45), ("w8", 200, 0.01), ("x", 210, 0.02)]]
    assert [p["name"] for p in search.frontier(pts)] == ["w4g128", "w4g64", "w8"]


def _logits(model, ids):
    return model(ids, AttnMetadata(positions=torch.arange(ids.shape[1]).expand(ids.shape[0], -1)))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("unit", ["block", "linear"])
def test_a_replayed_unit_equals_the_whole_model_forward_of_a_really_quantized_copy(tiny_models, family, unit):
    """The golden path: quantize the unit alone with quantize_model (an override recipe), run the whole model
    through its own forward and compute the full-vocabulary KLD the slow way."""
    folder, _ = tiny_models[family]
    model = load_model(folder, torch.float32)
    ids = torch.randint(2, 128, (3, 24), generator=torch.Generator().manual_seed(1))
    ref = Reference(model, ids)
    us = units(model, unit)
    pick = [us[0], us[-1]]
    scheme = parse_scheme("w4g32")
    rows = measure(model, ref, pick, [scheme, parse_scheme("w8")], log=lambda m: None)
    p = torch.log_softmax(_logits(model, ids)[:, 12:-1].float(), -1)
    for u, row in zip(pick, rows):
        recipe = recipe_from_dict({"name": "one", "weights": {"bits": 4, "group_size": 32, "method": "rtn",
                                                              "overrides": [{"match": "*", "fp": True},
                                                                            {"match": u.pattern, "bits": 4}]}}, "t")
        q = load_model(folder, torch.float32)
        quantize_model(q, recipe, None, log=lambda m: None)
        lq = torch.log_softmax(_logits(q, ids)[:, 12:-1].float(), -1)
        slow = (p.exp() * (p - lq)).sum(-1).mean().item()
        assert slow > 0
        assert row["kld"]["w4g32"]["mean"] == pytest.approx(slow, rel=2e-3, abs=1e-6), (u.name, slow)
        assert row["bytes"]["w4g32"] < row["bytes"]["w8"]
    # the fp model is left as it was
    assert torch.equal(_logits(model, ids), _logits(load_model(folder, torch.float32), ids))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_head_in_row_chunks_gives_the_same_bits_as_one_pass(tiny_models, family, monkeypatch):
    """The reference and every replay run the head, log-softmax and divergence a chunk of scored rows at a time;
    chunks that split windows (and a short last chunk) must not change a bit of what one pass over all rows gives,
    nor the golden full-vocabulary KLD of the fp model against itself with one linear perturbed."""
    import qbench.tune.reference as reference
    model = load_model(tiny_models[family][0], torch.float32)
    ids = torch.randint(2, 128, (3, 24), generator=torch.Generator().manual_seed(2))
    lin = model.get_submodule(units(model, "linear")[-1].linears[0])
    W = lin.weight.detach().clone()
    out = {}
    for rows in (128, 5):
        monkeypatch.setattr(reference, "ROWS", rows)
        ref = Reference(model, ids)
        lin.set_weight(W * 1.05)
        try:
            out[rows] = (ref.nll_fp(), ref.replay(model.config.num_layers - 1))
        finally:
            lin.set_weight(W)
    assert out[128][0].shape == (3 * 11,)
    assert torch.equal(out[128][0], out[5][0])
    for k in ("kld", "nll"):
        assert torch.equal(out[128][1][k], out[5][1][k]), k
    p = torch.log_softmax(_logits(model, ids)[:, 12:-1].float(), -1).reshape(-1, model.config.vocab_size)
    lin.set_weight(W * 1.05)
    lq = torch.log_softmax(_logits(model, ids)[:, 12:-1].float(), -1).reshape(p.shape)
    lin.set_weight(W)
    slow = (p.exp() * (p - lq)).sum(-1)
    assert slow.mean() > 0
    torch.testing.assert_close(out[5][1]["kld"], slow.clamp(min=0), rtol=2e-3, atol=1e-6)


def test_a_tuned_recipe_is_a_valid_recipe_with_one_override_per_unit_off_the_base(tiny_models):
    model = load_model(tiny_models["llama"][0], torch.float32)
    us = {u.name: u for u in units(model, "linear")}
    schemes = {s.name: s for s in parse_schemes("w4g32,w8,fp")}
    choice = {n: "w4g32" for n in us}
    choice["blocks.0.qkv"], choice["blocks.1.down_proj"] = "w8", "fp"
    r = recipe_for("mix", choice, us, schemes, "d")
    assert r["weights"]["overrides"] == [{"match": "blocks.0.qkv", "bits": 8}, {"match": "blocks.1.down_proj", "fp": True}]
    rec = recipe_from_dict(r, "mix")
    assert rec.weights.linear_scheme("blocks.0.qkv")[:3] == (8, None, True)
    assert rec.weights.linear_scheme("blocks.1.down_proj") is None
    assert rec.weights.linear_scheme("blocks.1.o_proj")[:3] == (4, 32, True)
    blocks = {u.name: u for u in units(model, "block")}
    r = recipe_for("b", {"blocks.0": "w8", "blocks.1": "w8"}, blocks, schemes, "")
    assert r["weights"]["bits"] == 8 and "overrides" not in r["weights"]


def test_budgets_are_checked():
    assert Budget.of(0.05, None).metric == "kld"
    assert Budget.of(None, 1.1).value == pytest.approx(0.0953102, rel=1e-5)
    for kld, ppl, msg in [(None, None, "exactly one"), (0.1, 1.1, "exactly one"), (-1.0, None, "positive"),
                          (None, 0.9, "above 1")]:
        with pytest.raises(QBenchError, match=msg):
            Budget.of(kld, ppl)


def _sens(folder, out, **kw):
    from qbench.tune.measured import run_sensitivity
    return run_sensitivity(str(folder), parse_schemes(kw.get("schemes", "w4g32,w8")), kw.get("unit", "block"), out,
                           2, 32, 0, log=lambda m: None)


def test_sensitivity_then_tune_write_their_files_and_the_recipe_quantizes(tiny_models, tmp_path, char_tokenizer):
    from qbench.tune.tune import run_tune
    folder, _ = tiny_models["llama"]
    sens = tmp_path / "s.json"
    rep = _sens(folder, sens, unit="linear")
    assert (tmp_path / "s.png").stat().st_size > 0 and len(rep["rows"]) == 8
    assert json.loads(sens.read_text())["written_by"] == "qbench sensitivity"
    _sens(folder, sens, unit="linear")  # its own file: replaced
    out = tmp_path / "tuned.yaml"
    w8 = 0.5 * sum(r["kld"]["w4g32"]["mean"] for r in rep["rows"])  # somewhere between the two uniform recipes
    r = run_tune(str(folder), Budget.of(w8, None), parse_schemes("w4g32,w8"), "linear", out, sens, 2, 32, 0, 2, 3,
                 log=lambda m: None)
    assert out.read_text().startswith("# written by qbench tune\n")
    assert (tmp_path / "tuned.tune.json").is_file() and (tmp_path / "tuned.pareto.png").stat().st_size > 0
    assert r["candidates"] and r["tuned"]["bytes"] == min(c["bytes"] for c in r["candidates"] if c["within"]) \
        if any(c["within"] for c in r["candidates"]) else True
    names = {p["name"] for p in r["held_out_uniform"]}
    assert names == {"w4g32", "w8", "fp"} and set(r["frontier"]["vs"]) == names
    assert r["budget"]["held"] == (r["budget"]["value"] <= r["budget"]["limit"])
    for c in r["candidates"]:  # within the budget means with two SE to spare on the search windows
        assert c["upper"] == pytest.approx(c["real"] + 2 * c["kld"]["se"]) and c["within"] == (c["upper"] <= w8)
    recipe = load_recipe(str(out))  # the written file is a recipe qbench takes as it is
    assert recipe.weights.method == "rtn"
    r = run_tune(str(folder), Budget.of(None, 1.2), parse_schemes("w4g32,w8"), "linear", out, sens, 2, 32, 0, 2, 2,
                 log=lambda m: None)  # a perplexity budget; its own files: replaced
    assert r["budget"]["metric"] == "dnll" and r["budget"]["held"] == (r["tuned"]["ppl_ratio"] <= 1.2)
    assert "PPL ratio <= 1.2" in load_recipe(str(out)).description
    # a sensitivity file measured per block serves no per-linear search
    blk = tmp_path / "b.json"
    _sens(folder, blk)
    with pytest.raises(QBenchError, match="its unit is block, not linear"):
        run_tune(str(folder), Budget.of(0.1, None), parse_schemes("w4g32,w8"), "linear", tmp_path / "x.yaml", blk, 2,
                 32, 0, 2, 1, log=lambda m: None)
    with pytest.raises(QBenchError, match="no measurement for w4g64"):
        run_tune(str(folder), Budget.of(0.1, None), parse_schemes("w4g64,w8"), "block", tmp_path / "x.yaml", blk, 2,
                 32, 0, 2, 1, log=lambda m: None)
    with pytest.raises(QBenchError, match="other calibration windows"):
        run_tune(str(folder), Budget.of(0.1, None), parse_schemes("w4g32,w8"), "block", tmp_path / "x.yaml", blk, 2,
                 32, 5, 2, 1, log=lambda m: None)
    assert not (tmp_path / "x.yaml").exists()


def test_files_qbench_did_not_write_are_never_replaced(tiny_models, tmp_path):
    folder, _ = tiny_models["llama"]
    mine = tmp_path / "notes.json"
    mine.write_text('{"mine": true}')
    (tmp_path / "fig.png").write_bytes(b"not ours")
    (tmp_path / "fig.json").write_text("")
    (tmp_path / "r.yaml").write_text("name: mine\n")
    (tmp_path / "t.pareto.png").write_bytes(b"mine")
    cases = [
        (["sensitivity", folder, "--out", mine], "not a report qbench sensitivity wrote"),
        (["sensitivity", folder, "--out", tmp_path / "fig.json"], "not a report qbench sensitivity wrote"),
        (["sensitivity", folder, "--out", tmp_path / "new.json", "--schemes", "w4g96"], "needs a group size"),
        (["tune", folder, "--max-kld", "0.1", "--out", tmp_path / "r.yaml"], "not a recipe qbench tune wrote"),
        (["tune", folder, "--max-kld", "0.1", "--out", tmp_path / "t.yaml"], "t.pareto.png: exists and is not"),
        (["tune", folder, "--out", tmp_path / "u.yaml"], "exactly one budget"),
        (["tune", folder, "--max-kld", "0.1", "--margin-se", "-1", "--out", tmp_path / "u.yaml"], "--margin-se -1.0"),
        (["tune", folder, "--max-kld", "0.1", "--out", tmp_path / "u.txt"], "ending in .yaml"),
    ]
    for args, msg in cases:
        r = run_qbench(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert mine.read_text() == '{"mine": true}' and (tmp_path / "r.yaml").read_text() == "name: mine\n"
    assert (tmp_path / "fig.png").read_bytes() == b"not ours" and (tmp_path / "t.pareto.png").read_bytes() == b"mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fig.json", "fig.png", "notes.json", "r.yaml", "t.pareto.png"]


def test_the_lower_hull_drops_points_above_the_segment_of_their_neighbours():
    pts = [{"name": n, "bytes": b, "loss": l} for n, b, l in
           [("a", 100, 0.6), ("b", 110, 0.55), ("c", 120, 0.2), ("d", 200, 0.0)]]
    assert [p["name"] for p in search.lower_hull(pts)] == ["a", "c", "d"]  # b lies above the segment a-c
    (p0, w0), (p1, w1) = search.hull_weights(search.lower_hull(pts), 160)
    assert (p0["name"], p1["name"]) == ("c", "d") and w0 == pytest.approx(0.5) and w1 == pytest.approx(0.5)
    assert search.hull_weights(search.lower_hull(pts), 90) is None

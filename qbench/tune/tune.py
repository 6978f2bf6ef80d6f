"""`qbench tune MODEL --max-kld X | --max-ppl-ratio Y --out RECIPE.yaml`: the per-unit mix of schemes with the
fewest bytes whose loss stays within the budget.

1. Sensitivities (measured now, or read from `qbench sensitivity`'s file) on seeded WikiText-2 valid windows.
2. Greedy on them (``search.greedy``), then the chosen recipe is really quantized (RTN, every unit at once) and
   scored on the same windows. When the real loss exceeds the budget (the units' losses do not add up exactly)
   the target is tightened by the ratio and the search runs again; when it is well inside, loosened. The
   cheapest candidate within the budget wins.
3. The winner and the uniform recipes of each scheme are scored on WikiText-2 *test* windows, which the search
   never saw: whether the budget held there (with its SE), and where the winner lies against the uniform
   frontier (a paired difference per token, so the SE is that of the difference).
"""

from __future__ import annotations

import copy
import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from qbench.errors import QBenchError
from qbench.tune import search
from qbench.tune.measured import load_fp, measure_all, read_sensitivity, search_windows, \
    unit_list_for
from qbench.tune.reference import Reference
from qbench.tune.sensitivity import Scheme, mean_se

WRITER = "qbench tune"
TEST_TEXT = "evals/data/wikitext-2-raw/wiki.test.raw"


@dataclass(frozen=True)
class Budget:
    metric: str  # "kld" (mean KL divergence) or "dnll" (mean change of -log p: log of the PPL ratio)
    value: float  # in the metric's units
    label: str

    @staticmethod
    def of(max_kld: float | None, max_ppl_ratio: float | None) -> "Budget":
        if (max_kld is None) == (max_ppl_ratio is None):
            raise QBenchError("give exactly one budget: --max-kld X or --max-ppl-ratio Y")
        if max_kld is not None:
            if not max_kld > 0 or not math.isfinite(max_kld):
                raise QBenchError(f"--max-kld {max_kld}: must be a positive number, e.g. 0.05")
            return Budget("kld", max_kld, f"mean KLD <= {max_kld:g}")
        if not max_ppl_ratio > 1 or not math.isfinite(max_ppl_ratio):
            raise QBenchError(f"--max-ppl-ratio {max_ppl_ratio}: must be a number above 1, e.g. 1.05")
        return Budget("dnll", math.log(max_ppl_ratio), f"PPL ratio <= {max_ppl_ratio:g}")

    def loss(self, per_token: dict[str, torch.Tensor]) -> float:
        return per_token[self.metric].double().mean().item()


def recipe_for(name: str, choice: dict[str, str], unit_by_name: dict, schemes: dict[str, Scheme],
               description: str) -> dict:
    """The recipe of a choice: the most used quantized scheme as the base, every other unit as an override."""
    order = list(schemes)
    counts = Counter(s for s in choice.values() if not schemes[s].fp)
    base = schemes[min(counts, key=lambda s: (-counts[s], order.index(s)))] if counts else \
        next(s for s in schemes.values() if not s.fp)
    weights = {"bits": base.bits, "group_size": base.group_size, "symmetric": base.symmetric, "method": "rtn"}
    overrides = []
    for u, s in choice.items():  # in the units' order
        if s == base.name:
            continue
        sc = schemes[s]
        o = {"match": unit_by_name[u].pattern}
        if sc.fp:
            o["fp"] = True
        elif sc.bits == 8:
            o["bits"] = 8
        else:
            o.update(bits=4, group_size=sc.group_size, symmetric=sc.symmetric)
        overrides.append(o)
    if overrides:
        weights["overrides"] = overrides
    return {"name": name, "description": description, "weights": weights}


def evaluate(fp_model, recipe: dict, ref: Reference) -> dict[str, torch.Tensor]:
    """Quantize a copy of the fp model with ``recipe`` (qbench's real path) and score it -> per-token kld, dnll."""
    from qbench.quant.apply import quantize_model
    from qbench.quant.recipe import recipe_from_dict
    r = recipe_from_dict(recipe, f"the recipe {recipe['name']}")
    model = copy.deepcopy(fp_model)
    quantize_model(model, r, None, log=lambda m: None)
    out = ref.replay(0, model)
    del model
    return {"kld": out["kld"], "dnll": out["nll"] - ref.nll_fp()}


def uniform(name: str, s: Scheme, unit_by_name: dict) -> dict:
    return recipe_for(name, {u: s.name for u in unit_by_name}, unit_by_name, {s.name: s},
                      f"every decoder linear {s.name}, round to nearest")


def _summary(per_token: dict[str, torch.Tensor], nbytes: int) -> dict:
    d = mean_se(per_token["dnll"])
    return {"bytes": nbytes, "kld": mean_se(per_token["kld"]), "ppl_ratio": math.exp(d["mean"]),
            "ppl_ratio_se": math.exp(d["mean"]) * d["se"]}


def frontier_check(tuned: dict, tuned_tokens: dict, points: list[dict], tokens: dict[str, dict]) -> dict:
    """Where the tuned mix lies against the uniform recipes, in KLD, with paired per-token differences.

    The frontier is the staircase of the uniform points: at b bytes, the lowest KLD of a uniform recipe that fits
    in b. The tuned mix lies below it when its KLD is lower than that recipe's beyond 2 SE (lower KLD at no more
    bytes), or when it takes fewer bytes than a uniform recipe at an equal or lower mean KLD."""
    vs = {}
    for p in points:
        d = mean_se(tokens[p["name"]]["kld"] - tuned_tokens["kld"])
        vs[p["name"]] = {"bytes": p["bytes"], "bytes_ratio": tuned["bytes"] / p["bytes"],
                         "kld_minus_tuned": d["mean"], "se": d["se"]}
    fits = [p for p in points if p["bytes"] <= tuned["bytes"]]
    left = min(fits, key=lambda p: p["kld"]["mean"])["name"] if fits else None
    lower = left is not None and vs[left]["kld_minus_tuned"] > 2 * vs[left]["se"]
    cheaper = [n for n, v in vs.items() if v["bytes"] > tuned["bytes"] and v["kld_minus_tuned"] >= 0]
    pts = [{"name": p["name"], "bytes": p["bytes"], "loss": p["kld"]["mean"]} for p in points]
    out = {"frontier": [p["name"] for p in search.frontier(pts)], "best_within_bytes": left,
           "lower_kld_beyond_2se": lower, "fewer_bytes_than": cheaper, "below": bool(lower or cheaper), "vs": vs}
    # the stricter line: a proportional mix of two uniform recipes (the lower convex hull), paired per token
    w = search.hull_weights(search.lower_hull(pts), tuned["bytes"])
    if w is not None:
        d = mean_se(sum(wt * tokens[p["name"]]["kld"] for p, wt in w) - tuned_tokens["kld"])
        out["mix_line"] = {"of": " + ".join(f"{wt:.3f} x {p['name']}" for p, wt in w),
                           "kld_minus_tuned": d["mean"], "se": d["se"], "below": d["mean"] > 2 * d["se"]}
    return out


def _search(fp, rows, names, schemes, unit_by_name, budget, ref, fixed, rounds, name, margin, log) -> tuple[list, dict]:
    """Candidates until one is within the budget with ``margin`` SE to spare (its loss on the search windows plus
    margin x its SE), close to it; the cheapest such candidate wins."""
    tried, target, best = [], budget.value, None
    seen = set()
    for r in range(rounds):
        choice = search.greedy(rows, names, target, budget.metric)
        key = tuple(sorted(choice.items()))
        if key in seen:
            break
        seen.add(key)
        recipe = recipe_for(name, choice, unit_by_name, schemes, "")
        per_token = evaluate(fp.model, recipe, ref)
        real = budget.loss(per_token)
        upper = real + margin * mean_se(per_token[budget.metric])["se"]  # what the budget must hold
        cand = {"round": r, "target": target, "predicted": search.predicted(rows, choice, budget.metric),
                "real": real, "upper": upper, "bytes": search.total_bytes(rows, choice, fixed),
                "within": upper <= budget.value,
                "schemes": dict(Counter(choice.values())), "choice": choice,
                "kld": mean_se(per_token["kld"]), "dnll": mean_se(per_token["dnll"])}
        tried.append(cand)
        log(f"  round {r}: target {target:.5g}, predicted {cand['predicted']:.5g}, real {real:.5g} "
            f"(+ {margin:g} SE: {upper:.5g}, {'within' if cand['within'] else 'over'} the budget), "
            f"{cand['bytes'] / 2**20:.1f} MiB")
        if cand["within"] and (best is None or cand["bytes"] < best["bytes"]):
            best = cand
        if upper <= 0 or (cand["within"] and upper >= 0.9 * budget.value):
            break
        # the sum of single-unit losses misses their interaction (and the margin): rescale the target by the miss
        target = target * budget.value / upper if budget.metric == "kld" else target + budget.value - upper
    if best is None:
        best = min(tried, key=lambda c: c["upper"])
        log(f"  no candidate met the budget on the search windows; keeping the closest ({best['upper']:.5g})")
    return tried, best


def run_tune(model_spec: str, budget: Budget, schemes: list[Scheme], unit: str, out: Path,
             sensitivity: Path | None, samples: int, seq_len: int, seed: int, verify_chunks: int, rounds: int,
             log=print, margin: float = 2.0) -> dict:
    from qbench.evals.chunks import chunk_windows
    from qbench.evals.data import load_text
    from qbench.tune.figures import pareto_figure
    from qbench.tune.output import check_recipe_file, check_report, write_recipe, write_report

    t0 = time.perf_counter()
    out = Path(out)
    if out.suffix not in (".yaml", ".yml"):
        raise QBenchError(f"--out {out}: give a recipe file name ending in .yaml")
    report_path, fig_path = out.with_suffix(".tune.json"), out.with_suffix(".pareto.png")
    check_recipe_file(out)
    check_report(report_path, fig_path, WRITER)
    for opt, v in (("--verify-chunks", verify_chunks), ("--rounds", rounds)):
        if v < 1:
            raise QBenchError(f"{opt} {v}: must be a positive integer")
    if not margin >= 0 or not math.isfinite(margin):
        raise QBenchError(f"--margin-se {margin}: must be a number >= 0 (standard errors kept between the search's "
                          f"loss and the budget)")
    quantized = [s for s in schemes if not s.fp]
    if not quantized:
        raise QBenchError("--schemes: give at least one quantized scheme (fp alone needs no search)")
    fp = load_fp(model_spec)
    unit_by_name = unit_list_for(fp.model, unit)
    windows, wrec = search_windows(fp.tokenizer, samples, seq_len, seed)
    ref = Reference(fp.model, windows)
    if sensitivity is not None:
        data = read_sensitivity(Path(sensitivity), fp, unit, schemes, wrec)
        log(f"sensitivities from {sensitivity}")
    else:
        log("measuring sensitivities (save them with `qbench sensitivity` to tune again without this step)")
        data = measure_all(fp, schemes, unit, windows, log, ref)
    rows, fixed = data["rows"], data["fixed_bytes"]
    if [r["unit"] for r in rows] != list(unit_by_name):
        raise QBenchError(f"{sensitivity}: its units are not this model's {unit}s; measure again")
    names = [s.name for s in schemes]
    by_name = {s.name: s for s in schemes}
    log(f"search for {budget.label} over {len(rows)} {unit}s, schemes {', '.join(names)}")
    tried, best = _search(fp, rows, names, by_name, unit_by_name, budget, ref, fixed, rounds, out.stem, margin, log)

    def point(name: str, per_token: dict, nbytes: int) -> dict:
        return {"name": name, **_summary(per_token, nbytes)}

    def uniform_points(r: Reference) -> tuple[list[dict], dict]:
        pts, tokens = [], {}
        for s in quantized:
            tokens[s.name] = evaluate(fp.model, uniform(s.name, s, unit_by_name), r)
            pts.append(point(s.name, tokens[s.name], fixed + sum(row["bytes"][s.name] for row in rows)))
        zeros = torch.zeros_like(r.nll_fp())
        tokens["fp"] = {"kld": zeros, "dnll": zeros}
        pts.append(point("fp", tokens["fp"], fixed + sum(row["params"] * 4 for row in rows)))
        return pts, tokens

    search_uniform, _ = uniform_points(ref)
    del ref
    log(f"held-out check on {verify_chunks} WikiText-2 test windows of {seq_len} tokens")
    ids = fp.tokenizer(load_text(TEST_TEXT, "qbench tune"))["input_ids"]
    test_ref = Reference(fp.model, torch.tensor(chunk_windows(ids, seq_len, verify_chunks)), keep_inputs=False)
    held_uniform, tokens = uniform_points(test_ref)
    mix = {"schemes": best["schemes"], "search_kld": best["kld"], "search_real": best["real"],
           "search_upper": best["upper"], "margin_se": margin}
    summary = (f"{budget.label} on {model_spec}; per {unit}, from {', '.join(names)}; "
               + ", ".join(f"{n} {k}" for n, k in sorted(best["schemes"].items())))
    recipe = recipe_for(out.stem, best["choice"], unit_by_name, by_name, f"qbench tune: {summary}")
    tuned_tokens = evaluate(fp.model, recipe, test_ref)
    tuned = point(out.stem, tuned_tokens, best["bytes"])
    loss = mean_se(tuned_tokens[budget.metric])
    held = {"budget": budget.label, "metric": budget.metric, "limit": budget.value, "value": loss["mean"],
            "se": loss["se"], "held": loss["mean"] <= budget.value,
            "z": (budget.value - loss["mean"]) / loss["se"] if loss["se"] > 0 else float("inf")}
    front = frontier_check(tuned, tuned_tokens, held_uniform, tokens)
    recipe["description"] += (f". Held out (WikiText-2 test, {test_ref.tokens} tokens): KLD "
                              f"{tuned['kld']['mean']:.4f} +- {tuned['kld']['se']:.4f}, PPL ratio "
                              f"{tuned['ppl_ratio']:.4f}, {tuned['bytes'] / 2**20:.1f} MiB of weights; budget "
                              f"{'held' if held['held'] else 'NOT held'}")
    report = {"model": model_spec, "source_sha256": fp.source_sha256, "unit": unit, "schemes": names,
              "budget": held, "recipe": out.name, "figure": fig_path.name, "search_windows": wrec,
              "held_out": {"data": TEST_TEXT, "chunks": verify_chunks, "ctx": seq_len, "tokens": test_ref.tokens},
              "sensitivity": str(sensitivity) if sensitivity else "measured in this run", "mix": mix,
              "candidates": tried, "search_uniform": search_uniform, "held_out_uniform": held_uniform,
              "tuned": tuned, "frontier": front, "seconds": round(time.perf_counter() - t0, 1)}
    fig = pareto_figure(search_uniform, tried, held_uniform, tuned,
                        budget.value if budget.metric == "kld" else None, f"qbench tune: {summary}")
    check_recipe_file(out)
    check_report(report_path, fig_path, WRITER)
    write_report(report_path, report, WRITER, fig, fig_path)
    write_recipe(out, recipe)
    return report

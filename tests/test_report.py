"""qbench compare: the report is built from the run records, refuses mismatched runs, and is self-contained."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import SMOL, run_qbench

SUITE = """name: mini
seed: 11
batch_size: 4
tasks:
  kld: {data: evals/data/wikitext-2-raw/wiki.test.raw, ctx: 128, chunks: 4, top_k: 32, exact_chunks: 1}
  needle: {lengths: [256, 512], depths: [0, 100], kinds: [niah_single_noise, niah_multikey], max_new_tokens: 16}
  gsm8k_cot: {limit: 3, max_new_tokens: 24}
  speed: {prompt_tokens: 64, new_tokens: 8, batch_sizes: [1, 2]}
"""


qbench = run_qbench


@pytest.fixture(scope="module")
def runs(tmp_path_factory, smollm2):
    d = tmp_path_factory.mktemp("runs")
    suite = d / "mini.yaml"
    suite.write_text(SUITE)
    for name, extra in (("fp", []), ("kv4", ["--kv", "kv4", "--baseline", str(d / "fp")]),
                        ("k4v2", ["--kv", "k4v2", "--baseline", str(d / "fp")])):
        p = qbench("eval", SMOL, "--suite", str(suite), "--out", str(d / name), *extra)
        assert p.returncode == 0, p.stderr
    return d


def test_the_report_holds_every_variants_numbers_from_the_records(runs, tmp_path):
    out = tmp_path / "report"
    p = qbench("compare", str(runs / "k4v2"), str(runs / "fp"), str(runs / "kv4"), "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert sorted(x.name for x in out.iterdir()) == [".qbench-output.json", "figures", "report.html", "report.md",
                                                     "summary.json"]
    s = json.loads((out / "summary.json").read_text())
    names = [v["name"] for v in s["variants"]]
    assert names == ["fp32", "fp32 + KV K4V2 G16 R16", "fp32 + KV K4V4 G16 R16"], names  # baseline first
    base, k4v2, kv4 = s["variants"]
    assert base["baseline"] and "kld" not in base and base["kv_bytes_per_token"] == 46080
    assert kv4["kv_bytes_per_token"] == 7920 and k4v2["kv_bytes_per_token"] == 6480
    assert base["bits_per_weight"] == pytest.approx(32.0) and base["weight_bytes"] == kv4["weight_bytes"]
    for v, run in ((kv4, "kv4"), (k4v2, "k4v2")):
        rec = json.loads((runs / run / "results.json").read_text())["tasks"]
        assert v["kld"]["mean"] == rec["kld"]["kld"]["mean"] and v["needle"]["score"] == rec["needle"]["score"]
        assert v["gsm8k_cot"]["strict"]["ci95"] == rec["gsm8k_cot"]["strict"]["ci95"]
        assert v["speed"]["1"]["decode_tokens_per_s"] > 0 and set(v["speed"]) == {"1", "2"}
        tests = {t["test"]: t for t in s["paired"][v["name"]]}
        assert {"gsm8k_cot strict", "needle", "ln PPL ratio"} <= set(tests)
        assert tests["needle"]["p_value"] == rec["needle"]["vs_baseline"]["mcnemar"]["p_value"]
        assert all(t["significant"] == (t["p_value"] < 0.05) for t in tests.values())
    assert kv4["kld"]["mean"] < k4v2["kld"]["mean"]  # 2-bit values cost more than 4-bit ones
    md = (out / "report.md").read_text()
    assert "not significant" in md and "## Paired significance" in md and "figures/kld_cdf.png" in md
    commits = {json.loads((runs / r / "results.json").read_text())["versions"]["qbench_commit"] for r in ("fp", "kv4")}
    assert all(c == list(commits) for c in s["code"].values()) and len(commits) == 1  # this checkout's, by eval
    assert f"Code: every run by qbench {next(iter(commits))[:12]}" in md
    html = (out / "report.html").read_text()
    srcs = re.findall(r"src='([^']*)'", html)
    assert len(srcs) == len(s["figures"]) == 5 and all(x.startswith("data:image/png;base64,") for x in srcs)
    assert "kv_pareto" in s["figures"]  # needle against one 16k sequence's KV bytes: the caches differ
    assert base["kv_bytes_per_sequence_16k"] == 16384 * 46080 and kv4["kv_bytes_per_sequence_16k"] == (
        16384 * 7920 + 30 * 2 * 16 * 3 * 64 * 4)  # the residual window: 16 fp32 tokens, K and V
    assert "http://" not in html and "https://" not in html  # nothing to fetch: one self-contained file
    for f in s["figures"]:
        assert (out / "figures" / f"{f}.png").read_bytes()[:4] == b"\x89PNG"


def test_runs_under_another_suite_or_seed_are_refused(runs, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(runs / "kv4", other)
    rec = json.loads((other / "results.json").read_text())
    rec["suite"]["seed"] = 12
    (other / "results.json").write_text(json.dumps(rec))
    out = tmp_path / "r"
    p = qbench("compare", str(runs / "fp"), str(other), "--out", str(out))
    assert p.returncode == 2 and "seed 12" in p.stderr and "re-run it with the baseline's suite" in p.stderr
    assert len([ln for ln in p.stderr.splitlines() if ln.strip()]) == 1 and not out.exists()
    p = qbench("compare", str(runs / "kv4"), str(runs / "k4v2"), "--out", str(out))
    assert p.returncode == 2 and "made without a baseline" in p.stderr and not out.exists()
    p = qbench("compare", str(runs / "fp"), str(tmp_path / "nope"), "--out", str(out))
    assert p.returncode == 2 and "not a finished qbench eval run" in p.stderr
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    p = qbench("compare", str(runs / "fp"), "--out", str(tmp_path / "busy"))
    assert p.returncode == 2 and "is not an output qbench wrote" in p.stderr
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"


def test_a_report_is_rebuilt_in_place(runs, tmp_path):
    out = tmp_path / "report"
    assert qbench("compare", str(runs / "fp"), str(runs / "kv4"), "--out", str(out)).returncode == 0
    assert qbench("compare", str(runs / "fp"), str(runs / "kv4"), "--out", str(out)).returncode == 0
    assert len(json.loads((out / "summary.json").read_text())["variants"]) == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_the_html_report_renders_in_headless_chromium(runs, tmp_path):
    from PIL import Image
    if shutil.which("chromium") is None:
        if os.environ.get("QBENCH_REQUIRE_BROWSER"):  # CI installs it (.ci/run): there the check must run
            pytest.fail("chromium is not installed; .ci/run installs Debian's chromium")
        pytest.skip("needs Debian's chromium (apt-get install chromium) for the browser check")
    out = tmp_path / "report"
    assert qbench("compare", str(runs / "fp"), str(runs / "kv4"), "--out", str(out)).returncode == 0
    shot = tmp_path / "shot.png"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars"]
    p = subprocess.run(["chromium", *flags, "--window-size=1280,2400", f"--screenshot={shot}",
                        (out / "report.html").as_uri()], capture_output=True, text=True, timeout=120)
    assert shot.is_file(), p.stderr[-2000:]
    img = Image.open(shot).convert("RGB")
    colors = img.getcolors(maxcolors=1 << 20)
    assert img.size == (1280, 2400) and len(colors) > 200  # tables and plots drawn, not a blank page
    dom = subprocess.run(["chromium", *flags, "--dump-dom", (out / "report.html").as_uri()], capture_output=True,
                         text=True, timeout=120).stdout
    assert dom.count("<img") == 5 and "Paired significance" in dom  # the KV Pareto: the caches differ


def _variant(name, tasks, baseline=False, kv_source=None):
    from qbench.report.collect import Variant
    rec = {"suite": {"name": "s", "hash": "h", "seed": 1}, "batch_size": 4, "tasks": tasks,
           "subject": {"model": "m", "recipe": None if baseline else name, "kv_scheme": "fp", "kv_source": kv_source,
                       "weight_bytes": 100, "kv_bytes_per_token": 10, "bits_per_weight": 32.0,
                       "quantized_linear_bits_per_weight": 32.0}}
    return Variant(name, Path("/nowhere") / name, rec, is_baseline=baseline)


def test_significance_is_read_from_the_paired_tests_not_from_overlapping_intervals():
    from qbench.report.render import markdown, page
    from qbench.report.summary import build
    vb = lambda p, d: {"mcnemar": {"p_value": p}, "diff_ci": {"diff": d, "low": d - 0.1, "high": d + 0.1}}  # noqa
    gsm = lambda p: {"items": 20, "strict": {"accuracy": 0.5, "ci95": [0.3, 0.7]},  # noqa
                     "flexible": {"accuracy": 0.6, "ci95": [0.4, 0.8]}, "vs_baseline": {"strict": vb(p, -0.2),
                                                                                          "flexible": vb(0.5, 0.0)}}
    kld = {"own": {"ppl": 10.0, "ppl_se": 0.5}, "score": 0.1, "kld": {"mean": 0.1, "se": 0.01, "median": 0.05,
           "p99": 1.0, "max": 3.0}, "same_top_p": {"mean": 0.9, "se": 0.01}, "delta_p": {"rms": 0.05, "rms_se": 0.001},
           "ppl_ratio": {"value": 1.01, "se": 0.02}, "ln_ppl_ratio": {"value": 0.00995, "se": 0.0198}}
    base = _variant("fp32", {"kld": {"own": {"ppl": 9.9, "ppl_se": 0.5}, "score": None}}, baseline=True)
    a = _variant("a", {"gsm8k": gsm(0.01), "kld": kld})
    s = build([base, a])
    tests = {t["test"]: t for t in s["paired"]["a"]}
    assert tests["gsm8k strict"]["significant"] and not tests["gsm8k flexible"]["significant"]
    assert not tests["ln PPL ratio"]["significant"] and tests["ln PPL ratio"]["p_value"] == pytest.approx(0.615, abs=0.01)
    assert s["variants"][1]["ppl_ratio"]["significant"] is False
    md, html = markdown(s, {}), page(s, {})
    assert "1.0100 ± 0.0200 (not significant)" in md and "| a | gsm8k strict | -0.200 |" in md
    assert "<td class='sig'>significant</td>" in html and "<td class='ns'>not significant</td>" in html


def test_a_variant_is_named_from_its_record():
    from qbench.report.collect import label
    rec = lambda recipe, kv, src: {"subject": {"recipe": recipe, "kv_scheme": kv, "kv_source": src}}  # noqa
    assert label(rec(None, "fp", None)) == "fp32"
    assert label(rec(None, "K4V4 G16 R16", "run")) == "fp32 + KV K4V4 G16 R16"
    assert label(rec("w4g128-kv4", "K4V4 G16 R16", "artifact")) == "w4g128-kv4"  # the recipe already says it


def test_the_report_says_when_its_runs_were_made_by_different_code():
    from qbench.report.render import code_line
    one = code_line({"code": {"fp32": "a" * 40, "w8": "a" * 40}})
    assert one == f"Code: every run by qbench {'a' * 12}."
    mixed = code_line({"code": {"fp32": None, "w8": None, "w4": "b" * 40 + "+dirty"}})
    assert mixed == f"Code: the runs were made by different qbench commits (fp32, w8: (commit not recorded); w4: {'b' * 12}+dirty)."
    resumed = code_line({"code": {"fp32": ["a" * 40], "w4": [None, "a" * 40], "w8": ["c" * 40, "a" * 40]}})
    assert resumed == (f"Code: the runs were made by different qbench commits (fp32: {'a' * 12}; w4: (commit not "
                       f"recorded) then {'a' * 12} (resumed); w8: {'c' * 12} then {'a' * 12} (resumed)).")


def test_the_report_marks_two_variants_of_one_recipe_with_different_weights():
    """Issue 21: the same recipe quantized on two machines gave another artifact; a report that holds both says
    so, naming the variants and their digests, and says nothing when the weights agree or the recipes differ."""
    from qbench.report.render import markdown, page
    from qbench.report.summary import build
    kld = {"own": {"ppl": 10.0, "ppl_se": 0.5}, "score": None}
    base = _variant("fp32", {"kld": kld}, baseline=True)

    def v(name, recipe, digest):
        x = _variant(name, {"kld": kld})
        x.record["subject"].update(recipe=recipe, weights_sha256=digest)
        return x
    s = build([base, v("awq-epyc", "w4g128-awq", "a" * 64), v("awq-xeon", "w4g128-awq", "b" * 64),
               v("w8", "w8", "c" * 64), v("w8-again", "w8", "c" * 64)])
    assert s["digest_conflicts"] == [{"recipe": "w4g128-awq", "digests": {"a" * 64: ["awq-epyc"], "b" * 64: ["awq-xeon"]}}]
    md, html = markdown(s, {}), page(s, {})
    line = (f"Same recipe, different weights: recipe w4g128-awq (awq-epyc: weights {'a' * 12}; awq-xeon: weights "
            f"{'b' * 12})")
    assert line in md and line in html and "recipe w8" not in md
    same = build([base, v("w8", "w8", "c" * 64), v("w8-again", "w8", "c" * 64)])
    assert same["digest_conflicts"] == [] and "Same recipe" not in markdown(same, {})


def test_a_run_resumed_on_another_machine_records_what_each_machine_computed(tmp_path):
    """A run folder carried to another CPU and resumed there says which machine computed which items; one
    machine's invocations of one commit count as one segment, as before."""
    from qbench.evals.provenance import code_segments, machines_of, open_segment
    from qbench.evals.store import RunStore
    xeon = {"cpu": "Xeon", "kernels": "avx512", "aten": "AVX512", "threads": 2, "torch": "2.13.0", "cpu_flags": ["avx2"]}
    epyc = dict(xeon, cpu="EPYC", kernels="avx2", aten="AVX2")
    store = RunStore(tmp_path / "run")
    open_segment(store, "a" * 40, xeon)
    store.add_item("gsm8k", {"key": "g0"})
    open_segment(store, "a" * 40, dict(xeon, processes=1))  # fields that do not decide the numbers are not kept
    store.add_item("gsm8k", {"key": "g1"})
    open_segment(store, "a" * 40, epyc)  # the same commit on another CPU: a new segment
    store.add_item("gsm8k", {"key": "g2"})
    segs = code_segments(store)
    key = lambda m: {k: m[k] for k in ("cpu", "kernels", "aten", "threads", "torch")}  # noqa
    assert segs == [{"commit": "a" * 40, "machine": key(xeon), "computed": {"gsm8k": 2}},
                    {"commit": "a" * 40, "machine": key(epyc), "computed": {"gsm8k": 1}}]
    assert machines_of({"versions": {"code_segments": segs}}) == [key(xeon), key(epyc)]
    # a run from before segments kept machines: the machine its results.json names, or none
    assert machines_of({"versions": {"code_segments": [{"commit": None, "computed": {}}]}, "machine": epyc}) == [key(epyc)]
    assert machines_of({"versions": {}}) == []


def test_the_report_names_its_machine_and_warns_when_runs_mix_machines():
    from qbench.report.render import machine_lines, markdown, page
    from qbench.report.summary import build
    xeon = {"cpu": "Xeon", "kernels": "avx512", "aten": "AVX512", "threads": 2, "torch": "2.13.0"}
    epyc = dict(xeon, cpu="EPYC", kernels="avx2", aten="AVX2")
    one, warn = machine_lines({"machines": {"fp32": [xeon], "w8": [xeon]}})
    assert one == "Machine: every run on Xeon (kernels avx512, ATen AVX512, 2 threads, torch 2.13.0)." and warn == []
    one, (warn,) = machine_lines({"machines": {"fp32": [xeon], "w8": [epyc], "kv4": [xeon, epyc], "old": []}})
    assert one is None and warn.startswith("Different machines: the runs were not all computed on one machine (fp32: "
                                           "Xeon (kernels avx512, ATen AVX512, 2 threads, torch 2.13.0); w8: EPYC")
    assert "kv4: Xeon (kernels avx512, ATen AVX512, 2 threads, torch 2.13.0) then EPYC (kernels avx2, ATen AVX2, 2 " \
           "threads, torch 2.13.0) (resumed on another machine); old: (machine not recorded))." in warn
    kld = {"own": {"ppl": 10.0, "ppl_se": 0.5}, "score": None}
    base, a = _variant("fp32", {"kld": kld}, baseline=True), _variant("a", {"kld": kld})
    base.record["machine"], a.record["machine"] = dict(xeon, cpu_flags=["avx2"]), dict(epyc, cpu_flags=["avx2"])
    s = build([base, a])
    assert s["machines"] == {"fp32": [xeon], "a": [epyc]}
    md, html = markdown(s, {}), page(s, {})
    assert "**Different machines: the runs were not all computed on one machine (fp32: Xeon" in md
    assert "<p class='sig'>Different machines: the runs" in html and "Machine: every run" not in md
    a.record["machine"] = base.record["machine"]
    md = markdown(build([base, a]), {})
    assert "(commit not recorded). Machine: every run on Xeon (kernels avx512" in md and "Different machines" not in md


def test_a_run_resumed_on_other_code_records_what_each_commit_computed(tmp_path):
    import torch

    from qbench.evals.provenance import code_segments, commits_of, open_segment
    from qbench.evals.store import RunStore
    store = RunStore(tmp_path / "run")
    store.add_item("needle", {"key": "n0"})  # stored by a qbench that kept no segments
    open_segment(store, "a" * 40)
    store.add_item("needle", {"key": "n1"})
    store.save_part("kld", "chunk_00000", {"x": torch.zeros(2)})
    open_segment(store, "a" * 40)  # interrupted, resumed on the same code: one segment
    store.add_item("gsm8k", {"key": "g0"})
    open_segment(store, "b" * 40)  # pulled, resumed: computes one more item
    store.add_item("gsm8k", {"key": "g1"})
    store.add_item("gsm8k", {"key": "g1"})  # a redone item counts once
    open_segment(store, "c" * 40)  # a rerun that only reloads: computed nothing, not listed
    segs = code_segments(store)
    assert segs == [{"commit": None, "computed": {"needle": 1}},
                    {"commit": "a" * 40, "computed": {"needle": 1, "kld": 1, "gsm8k": 1}},
                    {"commit": "b" * 40, "computed": {"gsm8k": 1}}]
    assert commits_of({"versions": {"code_segments": segs, "qbench_commit": "c" * 40}}) == [None, "a" * 40, "b" * 40]
    assert commits_of({"versions": {"qbench_commit": "c" * 40}}) == ["c" * 40]  # a run from before segments


def test_points_that_would_overprint_share_one_label():
    """Two variants at nearly one point of a Pareto plot (w4g128 and w4g128-awq: the same bytes, KLD 0.176 and
    0.183 on a log axis) get one label with both names; points apart keep their own, in the axis' own scale."""
    from qbench.report.figures import _near
    mib = 2**20
    pts = [(2404 * mib, 0.0005, {}), (1381 * mib, 0.0015, {}), (1217 * mib, 0.176, {}), (1217 * mib, 0.183, {}),
           (440 * mib, 0.176, {})]
    assert _near(pts, logx=False, logy=True) == [0, 1, 2, 2, 4]
    assert _near(pts, logx=False, logy=False) == [0, 1, 2, 2, 4]
    # 0.0005 and 0.0015 differ by 0.5% of a linear span, but by a quarter of a log one
    close = [(1000 * mib, 0.0005, {}), (1000 * mib, 0.0015, {}), (2000 * mib, 0.2, {})]
    assert _near(close, logx=False, logy=False) == [0, 0, 2]
    assert _near(close, logx=False, logy=True) == [0, 1, 2]

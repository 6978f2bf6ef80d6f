"""The calibration's float64 passes, a run of windows at a time (passes.windows), and what keeps them cheap:
the heap that reuses their temporaries (heap.calibration_heap), GPTQ's Gram matrix built from its lower
triangle (gptq.gram), and output errors recorded from the Hessian (apply._record)."""

import json
import resource
import subprocess
import sys

import pytest
import torch

from qbench.models.registry import load_model
from qbench.quant import gptq, passes
from qbench.quant.apply import _record, quantize_model, rtn
from qbench.quant.recipe import load_recipe

RECIPES = {
    "awq-clip": "weights: {bits: 4, group_size: 32, symmetric: false, method: awq}\nawq: {clip: true}\n",
    "gptq": "weights: {bits: 4, group_size: 32, symmetric: true, method: gptq}\ngptq: {act_order: true}\n",
    "w8a8-sq": "weights: {bits: 8, group_size: null, method: rtn, activations: int8}\n"
               "smoothquant: {alpha: 0.5, search: true}\n",
}


@pytest.mark.parametrize("family", ["llama", "mistral-window", "qwen2", "gpt2"])
def test_the_passes_give_the_same_bits_a_window_at_a_time(tiny_models, family, monkeypatch):
    model = load_model(tiny_models[family][0])
    block = model.blocks[0]
    x = torch.randn(5, 24, model.config.hidden_size, generator=torch.Generator().manual_seed(0),
                    dtype=torch.float64)
    names = ["qkv", "o_proj", "down_proj"]
    got = []
    for chunk in (10 ** 6, 48, 24):  # all 5 windows at once; 2, 2 and 1; one at a time
        monkeypatch.setattr(passes, "CHUNK_TOKENS", chunk)
        with torch.inference_mode():
            from qbench.quant import wide
            wide.widen(block)
            got.append((passes.block_forward(model.config, block, x),
                        passes.capture(model.config, block, x, names, max_tokens=64)))
            wide.narrow(block)
    assert len(list(passes.windows(model.config, x, 24))) == 5
    (y0, s0), *rest = got
    for y, s in rest:
        assert torch.equal(y, y0)
        assert list(s) == list(s0) and all(torch.equal(s[k], s0[k]) for k in s0 if torch.is_tensor(s0[k]))
        assert all(s[k] == s0[k] for k in s0 if not torch.is_tensor(s0[k]))
    assert s0["n:qkv"] == 5 * 24 and s0["qkv"].shape[0] == 64  # the subsample draws from every window


@pytest.mark.parametrize("family, method", [("llama", "awq-clip"), ("qwen2", "w8a8-sq"), ("gpt2", "gptq"),
                                            ("llama-tied-bias", "gptq")])
def test_a_calibration_a_window_at_a_time_quantizes_to_the_same_bits(tiny_models, tmp_path, family, method,
                                                                       monkeypatch):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: {method}\n{RECIPES[method]}"
                      "calibration: {data: evals/data/wikitext-2-raw/wiki.valid.raw, samples: 5, seq_len: 32}\n")
    calib = torch.randint(2, 128, (5, 32), generator=torch.Generator().manual_seed(1))
    results = []
    for chunk in (10 ** 6, 32):
        monkeypatch.setattr(passes, "CHUNK_TOKENS", chunk)
        model = load_model(tiny_models[family][0])
        res = quantize_model(model, load_recipe(str(recipe)), calib, log=lambda *a: None)
        results.append((res, model.state_dict()))
    (r0, sd0), (r1, sd1) = results
    assert sorted(r0.qtensors) == sorted(r1.qtensors) and r0.qtensors
    for name, q in r0.qtensors.items():
        q1 = r1.qtensors[name]
        for a, b in ((q.codes, q1.codes), (q.scale, q1.scale), (q.zero, q1.zero)):
            assert (a is None and b is None) or torch.equal(a, b), name
    for name, t in sd0.items():  # norms and biases with any smoothing folded in
        if t.is_floating_point():
            assert torch.equal(t, sd1[name]), name
    assert [r["output_rel_error"] for r in r0.layers if "output_rel_error" in r] == \
           [r["output_rel_error"] for r in r1.layers if "output_rel_error" in r]


@pytest.mark.parametrize("K", [7, gptq.GRAM_BLOCK, gptq.GRAM_BLOCK + 1, 1100])
def test_the_gram_matrix_from_its_lower_triangle_is_symmetric_and_equals_the_product(K):
    x = torch.randn(700, K, generator=torch.Generator().manual_seed(K), dtype=torch.float64)
    G = gptq.gram(x)
    ref = x.t() @ x
    assert torch.equal(G, G.t())
    assert ((G - ref).abs().max() / ref.abs().max()).item() < 1e-14


@pytest.mark.parametrize("K", [7, gptq.GRAM_BLOCK, gptq.GRAM_BLOCK + 1, 1100])
def test_the_quadratic_trace_from_the_lower_triangle_equals_the_full_product(K):
    g = torch.Generator().manual_seed(K)
    x = torch.randn(2 * K, K, generator=g, dtype=torch.float64) * (torch.rand(K, generator=g) + 0.1)
    H = gptq.gram(x) / x.shape[0]
    D = torch.randn(40, K, generator=g, dtype=torch.float64)
    full = (D @ H * D).sum()
    assert abs((gptq.quadratic_trace(D, H) - full) / full).item() < 1e-13


@pytest.mark.parametrize("K", [7, gptq.TRI_BLOCK, gptq.TRI_BLOCK + 1, 1700])
def test_the_blocked_triangular_inverse_equals_one_solve_against_the_identity(K):
    g = torch.Generator().manual_seed(K)
    x = torch.randn(2 * K, K, generator=g, dtype=torch.float64) * (torch.rand(K, generator=g) + 0.1)
    H = gptq.gram(x) / x.shape[0] + 0.01 * torch.eye(K, dtype=torch.float64)
    L = torch.linalg.cholesky(H)
    ref = torch.linalg.solve_triangular(L, torch.eye(K, dtype=torch.float64), upper=False)
    X = gptq.lower_inverse(L)
    assert torch.equal(torch.triu(X, 1), torch.zeros_like(X))  # the skipped zeros stay exact
    assert ((X - ref).abs().max() / ref.abs().max()).item() < 1e-13


@pytest.mark.parametrize("bits, group", [(4, 32), (8, None)])
def test_the_output_error_from_the_hessian_equals_the_one_from_the_inputs(bits, group):
    g = torch.Generator().manual_seed(bits)
    X = torch.randn(300, 96, generator=g, dtype=torch.float64) * (torch.rand(96, generator=g) * 3 + 0.1)
    W = torch.randn(40, 96, generator=g, dtype=torch.float64) * 0.05
    q = rtn(W.float(), bits, group, True)
    q.activations = "fp32"
    H, n = gptq.hessian_add(None, X, 0)
    from_x = _record("l", W, q, X)
    from_h = _record("l", W, q, X[:10], H, n)  # the Hessian, not the (here truncated) subsample, is used
    assert from_h["output_error_tokens"] == 300 and from_x["output_error_tokens"] == 300
    assert from_h["output_rel_error"] == pytest.approx(from_x["output_rel_error"], rel=1e-10)
    assert from_x["output_rel_error"] > 1e-4
    q.activations = "int8"  # int8 activations round the inputs: only the inputs can say what that costs
    assert _record("l", W, q, X[:10], H, n)["output_error_tokens"] == 10


# In a fresh process: what the heap holds depends on everything the process freed before (a test session's)
HEAP_CHECK = """
import json, resource, torch
from qbench import heap

def faults(rounds=6, mib=16):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        t = torch.ones(mib << 17, dtype=torch.float64)  # written whole, as an operation's output is
        del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2 ** 20

out = {"mallopt": heap.fix_mmap_threshold(), "outside": faults()}
before = rss()
with heap.calibration_heap() as took:
    out["took"] = took
    live = [torch.ones(16 << 17, dtype=torch.float64) for _ in range(6)]  # 96 MiB at once
    del live
    out["kept"] = rss() - before
    out["inside"] = faults()
out["back"] = rss() - before
out["after"] = faults()
print(json.dumps(out))
"""


def _heap_check() -> dict:
    r = subprocess.run([sys.executable, "-c", HEAP_CHECK], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_calibration_heap_reuses_freed_blocks_and_hands_them_back_after():
    # Some fresh processes refault part of the inside rounds (0, 8,192 and, once in CI on a loaded machine,
    # 16,384 of 24,576 pages), so the reuse is judged on the best of three processes; without
    # calibration_heap every process faults every page (24,582), so the best of three still fails then.
    runs = [_heap_check() for _ in range(3)]
    got = min(runs, key=lambda r: r["inside"])
    if not got["mallopt"]:
        pytest.skip("this C library has no mallopt")
    pages = 6 * (16 << 20) // resource.getpagesize()
    assert got["took"]
    # a fresh mapping faults in every page (fewer where the kernel gives huge pages); a reused block, none
    assert got["outside"] > pages // 2, (runs, pages)
    assert got["inside"] < pages // 2, (runs, pages)
    assert got["kept"] > 80 and got["back"] < 16, got  # kept while calibrating, handed back after


def test_gptq_quantizes_a_weight_stored_transposed_as_it_quantizes_a_row_major_one():
    """A widened linear's weight can be a transposed view; the native column loop reads raw rows."""
    g = torch.Generator().manual_seed(3)
    K, N = 256, 24
    x = torch.randn(512, K, generator=g, dtype=torch.float64) * (torch.rand(K, generator=g, dtype=torch.float64) + 0.1)
    H, _ = gptq.hessian_add(None, x, 0)
    W = torch.randn(N, K, generator=g, dtype=torch.float64) * 0.05
    a = gptq.gptq_quantize(W, H, 4, 128, True)
    b = gptq.gptq_quantize(W.t().contiguous().t(), H, 4, 128, True)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)

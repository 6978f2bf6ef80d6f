"""The one-call decode step (kernels/layer.c) against the layer-by-layer path it replaces: the same logits bit
for bit, for every family, weight scheme and KV scheme it takes; the others fall back; batched == sequential."""

import pytest
import torch

from conftest import FAMILIES
from qbench.engine import runner as runner_mod
from qbench.engine.engine import Engine
from qbench.engine.sampling import SamplingParams
from qbench.kernels import build
from qbench.layers import fused_decode
from qbench.layers.kv import QuantBlockKV
from qbench.layers.kvscheme import KVScheme
from qbench.models.registry import load_model
from qbench.quant.apply import quantize_model
from qbench.quant.recipe import load_recipe

pytestmark = pytest.mark.skipif(not build.available(), reason="native kernels not built here")

UNEVEN = [[5, 6, 7], list(range(10, 19)), list(range(20, 37)), list(range(40, 70))]
WEIGHTS = ["fp32", "w8", "w4g64", "w4g128-asym", "w4g64-head", "w4a8g64", "w8a8", "fp8"]
KV = [None, KVScheme(scheme="fp16"), KVScheme(scheme="bf16"), KVScheme(8, 8, v_group=16),
      KVScheme(4, 2, v_group=16), KVScheme(4, 4, v_group=16, residual=48), KVScheme(8, 8, scheme="fp8"),
      KVScheme(16, 4, v_group=16), KVScheme(4, 4, scheme="per-tensor")]
FUSABLE = {"llama", "llama-tied-bias", "llama3-rope", "mistral", "mistral-window", "qwen2"}


def _model(tiny_models, family, weights):
    model = load_model(tiny_models[family][0])
    if weights != "fp32":
        quantize_model(model, load_recipe(weights), None, log=lambda *a: None)
    return model


def _decode_logits(model, kv, monkeypatch, fused: bool, prompts=UNEVEN, steps=20):
    """A batched greedy run -> each row's tokens, whether each decode step ran in one call, and the pool."""
    monkeypatch.setenv("QBENCH_FUSED", "1" if fused else "0")
    eng = Engine(model, block_size=16, kv_scheme=kv, kv_capacity_tokens=512)
    ran = []
    real_run = fused_decode.FusedDecoder.run

    def counted(self, x, meta):
        out = real_run(self, x, meta)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(fused_decode.FusedDecoder, "run", counted)
    out = eng.generate(prompts, SamplingParams(max_new_tokens=steps, ignore_eos=True))
    monkeypatch.setattr(fused_decode.FusedDecoder, "run", real_run)
    return [s.output_ids for s in out], ran, eng.pool


def _recorded_decode(model, kv, monkeypatch, fused: bool):
    """_decode_logits, with every decode step's logits as well -> (tokens, ran, pool, logits per step)."""
    from qbench.engine import runner as runner_mod

    seen = []
    real = runner_mod.ModelRunner.decode
    monkeypatch.setattr(runner_mod.ModelRunner, "decode", lambda self, seqs: seen.append(real(self, seqs)) or seen[-1])
    ids, ran, pool = _decode_logits(model, kv, monkeypatch, fused)
    monkeypatch.setattr(runner_mod.ModelRunner, "decode", real)
    return ids, ran, pool, seen


def _kv_id(kv):
    return "fp32-cache" if kv is None else kv.describe()


# every family on every KV scheme (fp32 weights); every weight scheme on every KV scheme (qwen2, with q/k/v
# biases) and on the rest of the families (gpt2 included, which the one-call step does not take)
CASES = ([(f, "fp32", kv) for f in FAMILIES for kv in KV]
         + [("qwen2", w, kv) for w in WEIGHTS[1:] for kv in KV]
         + [("mistral-window", w, kv) for w in WEIGHTS[1:] for kv in (KV[1], KV[5])]
         + [(f, w, None) for f in FAMILIES for w in WEIGHTS[1:] if f not in ("qwen2", "mistral-window")]
         + [("gpt2", "w4g64", KV[1])])  # not taken: falls back whole


@pytest.mark.parametrize("family,weights,kv", CASES, ids=[f"{f}-{w}-{_kv_id(kv)}" for f, w, kv in CASES])
def test_the_one_call_step_equals_the_layer_by_layer_step(tiny_models, family, weights, kv, monkeypatch):
    model = _model(tiny_models, family, weights)
    logits = {}
    for fused in (False, True):
        ids, ran, pool, logits[fused] = _recorded_decode(model, kv, monkeypatch, fused)
        if fused:
            # the quantized layouts that qb_attention_kv reads in place (not the per-tensor baseline, nor 2-bit
            # codes at the tiny models' head_dim of 16: a 2-bit chunk is 32 channels)
            in_place = kv is None or not kv.quantized or pool.layers[0].decode_kernel
            assert in_place == (kv is None or kv.scheme != "per-tensor" and kv.v_bits != 2)
            takes = family in FUSABLE and in_place
            # every step ran in one call, or none did (a layout it does not take falls back whole)
            assert ran == ([True] * 19 if takes else []), (family, weights, ran)
    assert len(logits[False]) == len(logits[True]) == 19
    for a, b in zip(logits[False], logits[True]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kv", [None, KVScheme(scheme="bf16"), KVScheme(4, 4, v_group=16)], ids=_kv_id)
@pytest.mark.parametrize("weights", ["fp32", "w8", "w4g64"])
def test_batched_equals_sequential_on_the_one_call_step(tiny_models, weights, kv, monkeypatch):
    model = _model(tiny_models, "qwen2", weights)
    batched, ran, _ = _decode_logits(model, kv, monkeypatch, True, steps=24)
    assert ran and all(ran)
    assert batched == [_decode_logits(model, kv, monkeypatch, True, [p], steps=24)[0][0] for p in UNEVEN]


class _CountingDecodeCalls:
    """The kernels' library, counting qb_decode_layers calls."""

    def __init__(self, lib):
        self.lib, self.calls = lib, 0

    def __getattr__(self, name):
        fn = getattr(self.lib, name)
        if name != "qb_decode_layers":
            return fn

        def call(*args):
            self.calls += 1
            return fn(*args)
        return call


@pytest.mark.parametrize("kv", [KVScheme(4, 4, v_group=16), KVScheme(8, 8, v_group=16, residual=48),
                                KVScheme(16, 4, v_group=16), KVScheme(8, 8, scheme="fp8")], ids=_kv_id)
def test_a_quantized_pool_stores_leaving_blocks_between_the_write_and_attention(tiny_models, kv, monkeypatch):
    """Steps where a block leaves a quantized pool's window store it between each layer's KV write and its
    attention: inside the one call (qb_kv_store) for the KIVI and unquantized layouts, layer by layer in two
    native calls with torch's store between for FP8. The pool ends bit-identical to the layer-by-layer path's
    with the codecs' own quantize (torch), and so do the logits."""
    model = _model(tiny_models, "llama", "w4g64")
    pools, logits = {}, {}
    for fused in (False, True):
        monkeypatch.setenv("QBENCH_FUSED", "1" if fused else "0")
        if not fused:  # the reference: every block through Codec.quantize
            monkeypatch.setattr(QuantBlockKV, "native_store", property(lambda self: False))
        eng = Engine(model, block_size=16, kv_scheme=kv, kv_capacity_tokens=512)
        leaving, layer_calls, seen = [], [], []
        real_run, real_decode = fused_decode.FusedDecoder.run, runner_mod.ModelRunner.decode
        lib = _CountingDecodeCalls(build.load())
        monkeypatch.setattr(fused_decode.kernels, "load", lambda: lib)

        def run(self, x, meta):
            leaving.append(self.caches[0].decode_plan(meta)[1] is not None)
            before = lib.calls
            out = real_run(self, x, meta)
            layer_calls.append(lib.calls - before)
            return out

        monkeypatch.setattr(fused_decode.FusedDecoder, "run", run)
        monkeypatch.setattr(runner_mod.ModelRunner, "decode", lambda self, seqs: seen.append(
            real_decode(self, seqs)) or seen[-1])
        eng.generate([list(range(3, 30))], SamplingParams(max_new_tokens=40, ignore_eos=True))
        monkeypatch.undo()  # the wrappers, the library and (after the reference) the store
        pools[fused], logits[fused] = {k: t.clone() for k, t in eng.pool.store.items()}, seen
        if fused:
            # positions 27 to 65 written one by one: a block leaves the window as a step completes 32, 48 and
            # 64 tokens (R = 16), or 48 and 64 (R = 48)
            assert sum(leaving) == (3 if kv.residual == 16 else 2)
            staged = kv.scheme == "fp8"
            n_layers = len(eng.pool.layers)
            assert layer_calls == [2 * n_layers if (left and staged) else 1 for left in leaving]
    assert all(torch.equal(pools[False][k], pools[True][k]) for k in pools[False])
    assert len(logits[False]) == len(logits[True]) == 39
    assert all(torch.equal(a, b) for a, b in zip(logits[False], logits[True]))


@pytest.mark.skipif(not build.available() or build.load().qb_isa() != 512, reason="needs a CPU with AVX-512 VNNI")
@pytest.mark.parametrize("kv", [None, KVScheme(4, 4, v_group=16, residual=48), KVScheme(8, 8, scheme="fp8")],
                         ids=_kv_id)
@pytest.mark.parametrize("weights", ["fp32", "w8-h8e8", "w4g128-h8e8", "w4a8g64", "w8a8", "fp8"])
def test_a_decode_does_not_depend_on_the_native_kernels_instruction_set(tiny_models, weights, kv, monkeypatch):
    """Every native kernel's AVX-512 path gives its AVX2 path's bits (INT8 and INT4 linears, the INT8 head and
    table, integer activations, attention over quantized blocks), so a decode's logits and greedy tokens are the
    same on an AVX2-only CPU; only torch's own products (prefill's dense GEMM) still follow the CPU."""
    model = _model(tiny_models, "qwen2", weights)
    lib = build.load()
    runs = {}
    try:
        for isa in (256, 512):
            lib.qb_set_isa(isa)
            ids, _, _, seen = _recorded_decode(model, kv, monkeypatch, True)
            runs[isa] = (ids, seen)
    finally:
        lib.qb_set_isa(512)
    assert runs[256][0] == runs[512][0]
    assert len(runs[256][1]) == 19 and all(torch.equal(a, b) for a, b in zip(runs[256][1], runs[512][1]))

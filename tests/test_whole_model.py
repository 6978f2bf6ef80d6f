"""The whole model quantized: the output head under its own scheme and the embedding table stored INT8 per
row, fp16 or bf16. Golden reference: transformers running the same model with those two tensors replaced
by a float64 re-implementation of each scheme written here, not imported from qbench."""

import pytest
import torch

from conftest import run_qbench
from qbench.kernels import build
from qbench.quant.artifact import load_artifact
from qbench.quant.primitives import GROUP_SIZES, quantize_int4, quantize_int8
from qbench.quant.qembedding import Int8Embedding
from qbench.quant.qlinear import QuantLinear, make_qlinear
from qbench.quant.quantize import run_quantize


def _int8_rows(w):
    scale = (w.abs().amax(1) / 127).clamp(min=1e-8).half().double()
    return torch.clamp(torch.round(w / scale[:, None]), -127, 127) * scale[:, None]


def _int4(w, g, sym):
    N, K = w.shape
    wp = torch.nn.functional.pad(w, (0, -(-K // g) * g - K)).view(N, -1, g)
    if sym:
        s = (wp.abs().amax(-1) / 7).clamp(min=1e-8).half().double()[..., None]
        return (torch.clamp(torch.round(wp / s), -8, 7) * s).view(N, -1)[:, :K]
    lo, hi = wp.amin(-1).clamp(max=0), wp.amax(-1).clamp(min=0)
    s = ((hi - lo) / 15).clamp(min=1e-8).half().double()
    z = torch.clamp(torch.round(-lo / s), 0, 15)[..., None]
    s = s[..., None]
    return ((torch.clamp(torch.round(wp / s) + z, 0, 15) - z) * s).view(N, -1)[:, :K]


EMB = {"int8": _int8_rows, "fp16": lambda w: w.half().double(), "bf16": lambda w: w.bfloat16().double(),
       "fp32": lambda w: w}
CASES = [  # (embedding, head yaml, reference for the head)
    ("int8", "{bits: 8}", _int8_rows),
    ("fp16", "{bits: 4, group_size: 32, symmetric: true}", lambda w: _int4(w, 32, True)),
    ("int8", "{bits: 4, group_size: 64, symmetric: false}", lambda w: _int4(w, 64, False)),
    ("bf16", "false", None),
    ("fp32", "{bits: 8}", _int8_rows),
]


def _golden(hf_model, embedding: str, head_ref):
    """A copy of the transformers model with the table and the head replaced by the reference schemes."""
    import copy
    m = copy.deepcopy(hf_model)
    table = m.get_input_embeddings().weight.detach().double()
    head = m.get_output_embeddings().weight.detach().double()
    tied = m.get_input_embeddings().weight is m.get_output_embeddings().weight
    if tied:
        m.get_output_embeddings().weight = torch.nn.Parameter(head.clone().float())
    with torch.no_grad():
        m.get_input_embeddings().weight.copy_(EMB[embedding](table).float())
        if head_ref is not None:
            m.get_output_embeddings().weight.copy_(head_ref(head).float())
    return m


@pytest.mark.parametrize("family", ["llama", "llama-tied-bias", "qwen2", "gpt2"])
@pytest.mark.parametrize("embedding,head,head_ref", CASES)
def test_head_and_embedding_schemes_match_a_float64_reference(tiny_models, tmp_path, family, embedding, head, head_ref):
    folder, hf = tiny_models[family]
    tied = hf.config.tie_word_embeddings
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\nweights: {{bits: 8, group_size: null, lm_head: {head}, embedding: {embedding}, "
                      f"skip: ['blocks.']}}\n")
    if tied and head_ref is None and embedding != "fp32":
        p = run_qbench("quantize", folder, "--recipe", recipe, "--out", tmp_path / "a")
        assert p.returncode == 2 and "tied embeddings" in p.stderr and p.stderr.count("\n") == 1
        assert not (tmp_path / "a").exists()
        return
    m = run_quantize(str(folder), str(recipe), tmp_path / "a", log=lambda s: None)
    model, _ = load_artifact(tmp_path / "a")
    shared = tied and embedding == "int8" and head == "{bits: 8}"
    assert m["embedding"]["scheme"] == embedding and m["embedding"]["shared_with_lm_head"] == shared
    emb = getattr(model, model.embed_attr)
    if shared:  # one stored tensor: the INT8 head's codes serve the lookups
        assert emb is None and m["embedding"]["stored_as"] == ["lm_head.qweight", "lm_head.scales"]
        from safetensors import safe_open
        with safe_open(str(tmp_path / "a" / "model.safetensors"), "pt") as f:
            assert not any(k.startswith(model.embed_hf) for k in f.keys())
    elif embedding == "int8":
        assert isinstance(emb, Int8Embedding) and emb.codes.dtype == torch.int8
    else:
        assert emb is None or emb.weight.dtype == {"fp16": torch.float16, "bf16": torch.bfloat16,
                                                   "fp32": torch.float32}[embedding]
    ids = torch.randint(0, hf.config.vocab_size, (2, 12))
    from qbench.layers.attention import AttnMetadata
    got = model(ids, AttnMetadata(positions=torch.arange(12).expand(2, 12)))
    with torch.no_grad():
        want = _golden(hf, embedding, head_ref)(ids).logits
        fp = hf(ids).logits
    err = (got - want).abs().max().item()
    assert err < 2e-3, err
    if embedding != "fp32" or head_ref is not None:
        assert (fp - want).abs().max().item() > 10 * max(err, 1e-5)  # the schemes change the logits visibly


def test_an_unsupported_embedding_scheme_is_one_line_and_writes_nothing(tiny_models, tmp_path):
    folder, _ = tiny_models["llama"]
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\nweights: {bits: 4, group_size: 64, embedding: int4}\n")
    p = run_qbench("quantize", folder, "--recipe", recipe, "--out", tmp_path / "a")
    assert p.returncode == 2 and p.stderr.count("\n") == 1
    assert "weights.embedding: 'int4' is not supported (supported: fp32, fp16, bf16, int8)" in p.stderr
    assert str(recipe) in p.stderr and not (tmp_path / "a").exists()
    recipe.write_text("name: r\nweights: {bits: 4, group_size: 64, lm_head: {bits: 4, group_size: 96}}\n")
    p = run_qbench("quantize", folder, "--recipe", recipe, "--out", tmp_path / "a")
    assert p.returncode == 2 and "weights.lm_head.group_size: 96 is not supported" in p.stderr
    tied, _ = tiny_models["llama-tied-bias"]  # a skip list that keeps the head fp keeps the tied table fp too
    recipe.write_text("name: r\nweights: {bits: 8, group_size: null, lm_head: true, embedding: int8, skip: [lm_head]}\n")
    p = run_qbench("quantize", tied, "--recipe", recipe, "--out", tmp_path / "a")
    assert p.returncode == 2 and "tied embeddings" in p.stderr and not (tmp_path / "a").exists()


SHAPES = [(48, 64, False), (33, 96, True), (17, 200, True), (130, 576, False), (7, 130, True), (64, 896, True)]


@pytest.mark.parametrize("n,k,bias", SHAPES)
@pytest.mark.parametrize("scheme", ["int8"] + [f"int4-g{g}-{s}" for g in GROUP_SIZES for s in ("sym", "asym")])
def test_every_supported_shape_takes_the_native_path_when_the_kernels_are_built(n, k, bias, scheme, monkeypatch):
    """Bias, K not a multiple of the group or of 128, odd N: none may fall back to torch when the kernels exist."""
    if not build.available():
        pytest.skip("the native kernels are not built on this machine (no C compiler)")
    torch.manual_seed(n * k)
    w = torch.randn(n, k)
    if scheme == "int8":
        q = quantize_int8(w)
    else:
        _, g, s = scheme.split("-")
        q = quantize_int4(w, int(g[1:]), s == "sym")
    lin = make_qlinear(q, torch.randn(n) if bias else None)
    assert lin.impl == "native"
    calls = []
    real = build.load
    monkeypatch.setattr(build, "load", lambda: calls.append(1) or real())
    for name in ("_weight_int8pack_mm", "_weight_int4pack_mm_for_cpu"):
        monkeypatch.setattr(torch.ops.aten, name, lambda *a, **kw: pytest.fail("took torch's path"), raising=False)
    x = torch.randn(3, k)
    y = lin(x)
    assert calls  # the kernel ran
    ref = make_qlinear(q, lin.bias, impl="reference")(x)
    assert (y - ref).abs().max().item() < 1e-3 * (1 + ref.abs().max().item())


def test_a_loaded_artifact_runs_every_quantized_module_natively(tiny_models, tmp_path):
    if not build.available():
        pytest.skip("the native kernels are not built on this machine (no C compiler)")
    folder, _ = tiny_models["qwen2"]
    run_quantize(str(folder), "w4g128-h8e8", tmp_path / "a", log=lambda s: None)
    model, _ = load_artifact(tmp_path / "a")
    mods = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(mods) == 4 * 2 + 1 and all(m.impl == "native" for m in mods)

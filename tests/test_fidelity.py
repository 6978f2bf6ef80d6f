"""Artifact fidelity against an independent source.

Each weight scheme is written out here again, in float64, from the seeds' conventions (nothing is imported
from qbench.quant), applied to the source checkpoint's tensors, and compared element for element with what
a loaded artifact actually computes: every quantized linear is fed the identity matrix, so the check sees
the kernel layout the engine runs, not the canonical codes it was built from. At model level the loaded
artifact's logits must equal a transformers model carrying these reference weights, and its KL divergence
from the fp model must equal the reference model's (bounded from above and from below).
"""

import json

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import _tiny
from qbench.layers.attention import AttnMetadata
from qbench.quant.artifact import load_artifact
from qbench.quant.quantize import run_quantize


# ---- the schemes, re-implemented in float64 -------------------------------------------------------------

def _fp16(x: np.ndarray) -> np.ndarray:
    """Round to the nearest fp16 (ties to even), as the artifact stores scales."""
    return x.astype(np.float16).astype(np.float64)


def _round(x: np.ndarray) -> np.ndarray:
    return np.round(x)  # half to even, as torch.round


def ref_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per row: scale = absmax / 127 (fp16), codes in [-127, 127] -> (dequantized, w / scale)."""
    scale = _fp16(np.maximum(np.abs(w).max(axis=1) / 127.0, 1e-8))[:, None]
    ratio = w / scale
    return np.clip(_round(ratio), -127, 127) * scale, ratio


def ref_int4(w: np.ndarray, group: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    """Groups of ``group`` along the input (the last one padded with zeros). Symmetric: absmax / 7, codes in
    [-8, 7]. Asymmetric: the range [min(lo, 0), max(hi, 0)] / 15 with an integer zero point, codes in [0, 15]."""
    n, k = w.shape
    kp = -(-k // group) * group
    g = np.pad(w, ((0, 0), (0, kp - k))).reshape(n, kp // group, group)
    if symmetric:
        scale = _fp16(np.maximum(np.abs(g).max(-1) / 7.0, 1e-8))[..., None]
        ratio = g / scale
        deq = np.clip(_round(ratio), -8, 7) * scale
    else:
        lo, hi = np.minimum(g.min(-1), 0), np.maximum(g.max(-1), 0)
        scale = _fp16(np.maximum((hi - lo) / 15.0, 1e-8))[..., None]
        zero = np.clip(_round(-lo[..., None] / scale), 0, 15)
        ratio = g / scale
        deq = (np.clip(_round(ratio) + zero, 0, 15) - zero) * scale
    return deq.reshape(n, kp)[:, :k], ratio.reshape(n, kp)[:, :k]


def _e4m3_grid() -> np.ndarray:
    """The non-negative finite FP8 e4m3fn values in code order (codes 0..126; 127 is NaN), from the format's
    definition: subnormals m / 8 * 2^-6, normals 2^(e - 7) (1 + m / 8)."""
    return np.array([(m / 8) * 2.0 ** -6 if e == 0 else 2.0 ** (e - 7) * (1 + m / 8)
                     for e in range(16) for m in range(8)][:127])


def ref_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """e4m3 per row: scale = absmax / 448 (fp16), each w / scale rounded to the nearest grid value, ties to the
    even code. The ratio returned is the position in code space (a tie sits at .5), for assert_same."""
    grid = _e4m3_grid()
    scale = _fp16(np.maximum(np.abs(w).max(axis=1) / 448.0, 1e-7))[:, None]
    r = np.clip(np.abs(w / scale), 0, 448.0)
    hi = np.clip(np.searchsorted(grid, r), 1, 126)  # grid[hi - 1] <= r <= grid[hi]
    lo_v, hi_v = grid[hi - 1], grid[hi]
    pos = (hi - 1) + (r - lo_v) / (hi_v - lo_v)
    frac = pos - (hi - 1)
    code = np.where(frac > 0.5, hi, np.where(frac < 0.5, hi - 1, np.where((hi - 1) % 2 == 0, hi - 1, hi)))
    return np.sign(w) * grid[code] * scale, pos


def ref_scheme(w: np.ndarray, scheme: dict | None) -> tuple[np.ndarray, np.ndarray | None]:
    if scheme is None:
        return w, None
    if scheme.get("type") == "float":
        return ref_fp8(w)
    if scheme["bits"] == 8:
        return ref_int8(w)
    return ref_int4(w, scheme["group_size"], scheme.get("symmetric", True))


def ref_table(w: np.ndarray, storage: str) -> tuple[np.ndarray, np.ndarray | None]:
    if storage == "int8":
        return ref_int8(w)
    if storage == "fp16":
        return _fp16(w), None
    if storage == "bf16":
        return torch.from_numpy(w).to(torch.bfloat16).double().numpy(), None
    return w, None


def assert_same(got: np.ndarray, want: np.ndarray, ratio: np.ndarray | None, what: str) -> None:
    """Element for element. The one allowed difference: a value whose w / scale lies within 1e-5 of a
    rounding tie, where float32 (qbench) and float64 (here) may round to neighbouring codes."""
    diff = np.abs(got - want) > 1e-6 * max(1.0, np.abs(want).max())
    if ratio is not None:
        tie = np.abs(np.abs(ratio - np.floor(ratio)) - 0.5) < 1e-5
        diff &= ~tie
    assert not diff.any(), f"{what}: {int(diff.sum())} of {diff.size} weights differ from the reference scheme, " \
                           f"first at {np.argwhere(diff)[0].tolist()}"


# ---- the models and the recipes -------------------------------------------------------------------------

def _odd_llama():
    """Every width off the grid: K = 72 and 100 (not multiples of 32 or 128), N = 131 rows of head, odd."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(7)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=131, hidden_size=72, intermediate_size=100, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                     eos_token_id=1, tie_word_embeddings=False))
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return m.eval()


W8 = {"bits": 8, "group_size": None}
CASES = [  # (family, weights section): every weight scheme, every head scheme, every table storage
    ("odd", {**W8, "lm_head": True, "embedding": "int8"}),
    ("odd", {"bits": 4, "group_size": 32, "symmetric": True, "lm_head": {"bits": 8}, "embedding": "fp16"}),
    ("odd", {"bits": 4, "group_size": 32, "symmetric": False,
             "lm_head": {"bits": 4, "group_size": 128, "symmetric": False}, "embedding": "bf16"}),
    ("odd", {"bits": 4, "group_size": 64, "symmetric": True, "embedding": "int8"}),
    ("odd", {"bits": 4, "group_size": 64, "symmetric": False, "lm_head": True}),
    ("odd", {"bits": 4, "group_size": 128, "symmetric": True, "lm_head": {"bits": 8}, "embedding": "int8"}),
    ("odd", {"bits": 4, "group_size": 128, "symmetric": False,
             "lm_head": {"bits": 4, "group_size": 32, "symmetric": True}, "embedding": "int8"}),
    ("llama-tied-bias", {"bits": 4, "group_size": 128, "symmetric": True, "lm_head": {"bits": 8},
                         "embedding": "int8"}),  # one stored tensor is head and table
    ("llama-tied-bias", {"bits": 4, "group_size": 64, "symmetric": False, "lm_head": True, "embedding": "fp16"}),
    ("llama-tied-bias", {**W8, "lm_head": True, "embedding": "int8"}),
    ("qwen2", {"bits": 4, "group_size": 32, "symmetric": False, "lm_head": {"bits": 8}, "embedding": "int8"}),
    ("gpt2", {"bits": 4, "group_size": 64, "symmetric": True, "lm_head": {"bits": 8}, "embedding": "int8"}),
    ("gpt2", {**W8, "lm_head": True, "embedding": "bf16"}),
    ("odd", {**W8, "type": "float", "lm_head": True}),  # FP8 e4m3, the head too
    ("llama-tied-bias", {**W8, "type": "float", "lm_head": {"bits": 8}, "embedding": "int8"}),
    ("gpt2", {**W8, "type": "float"}),
]


def _case_id(case):
    fam, w = case
    s = "fp8" if w.get("type") == "float" else "w8" if w["bits"] == 8 else \
        f"w4g{w['group_size']}{'' if w['symmetric'] else '-asym'}"
    head = w.get("lm_head", False)
    h = "" if head is False else "-head" if head is True else \
        f"-h{head['bits']}" + (f"g{head['group_size']}" if head.get("group_size") else "")
    return f"{fam}-{s}{h}-e{w.get('embedding', 'fp32')}"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    out = {}
    for fam in sorted({f for f, _ in CASES}):
        m = _odd_llama() if fam == "odd" else _tiny(fam)
        d = tmp_path_factory.mktemp(f"src-{fam}")
        m.save_pretrained(str(d))
        out[fam] = d
    return out


def _source_tensor(state: dict, name: str, family: str) -> np.ndarray:
    """The checkpoint's (out, in) weight for a Hugging Face projection name (GPT-2 stores Conv1D as (in, out))."""
    for key in (name + ".weight", "transformer." + name + ".weight", "model." + name + ".weight"):
        if key in state:
            w = state[key].double()
            return (w.t() if family == "gpt2" and ".c_" in name else w).numpy()
    raise KeyError(name)


def _table_name(family: str) -> str:
    return "wte" if family == "gpt2" else "model.embed_tokens"


def _head_scheme(weights: dict) -> dict | None:
    head = weights.get("lm_head", False)
    return None if head is False else weights if head is True else {"symmetric": True, **head}


def _effective_weight(module, k: int) -> np.ndarray:
    """What a linear module computes, as an (out, in) matrix: its outputs for the identity, less the bias."""
    with torch.inference_mode():
        y = module(torch.eye(k)).double() - module(torch.zeros(1, k)).double()  # (K, N)
    return y.t().numpy()


def _quantized(src, weights: dict, tmp_path):
    """qbench quantize with a recipe of these weights (RTN), then load -> (model, manifest)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "fidelity", "weights": {"method": "rtn", **weights}}))
    run_quantize(str(src), str(recipe), tmp_path / "art", log=lambda s: None)
    return load_artifact(tmp_path / "art")


# ---- the tests ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_loaded_weights_equal_the_scheme_applied_to_the_source(sources, tmp_path, case, path):
    family, weights = case
    src = sources[family]
    model, manifest = _quantized(src, weights, tmp_path)
    state = load_file(str(src / "model.safetensors"))
    tied = "lm_head.weight" not in state
    head_scheme = _head_scheme(weights)

    checked = 0
    for mod_name, parts in model.linear_map():
        module = model.get_submodule(mod_name)
        if mod_name == "lm_head":
            srcw = _source_tensor(state, _table_name(family) if tied else "lm_head", family)
            want, ratio = ref_scheme(srcw, head_scheme)
            assert_same(_effective_weight(module, srcw.shape[1]), want, ratio, "lm_head")
            checked += 1
            continue
        got = _effective_weight(module, module.in_features)
        row = 0
        for hf_name, rows in parts:
            want, ratio = ref_scheme(_source_tensor(state, hf_name, family), weights)
            assert_same(got[row: row + rows], want, ratio, hf_name)
            row += rows
            checked += 1
        assert row == got.shape[0]
    assert checked == 4 * model.config.num_layers + 1 + (family != "gpt2") * 3 * model.config.num_layers

    # the embedding table as the engine looks it up
    table = _source_tensor(state, _table_name(family), family)
    ids = torch.arange(table.shape[0])
    mod = getattr(model, model.embed_attr)
    with torch.inference_mode():
        rows = (model.embed_from_head(ids[None]) if mod is None else mod(ids[None]))[0].double().numpy()
    storage = weights.get("embedding", "fp32")
    want, ratio = ref_table(table, storage)
    assert_same(rows, want, ratio, "embedding")
    recorded = manifest.get("embedding") or {}
    assert recorded.get("scheme", "fp32") == storage, json.dumps(recorded)


def _reference_model(src, family: str, weights: dict):
    """transformers' model in float64 with every weight replaced by the reference scheme's values."""
    hf = AutoModelForCausalLM.from_pretrained(str(src), torch_dtype=torch.float64).eval()
    head_scheme = _head_scheme(weights)
    emb = weights.get("embedding", "fp32")
    table = hf.get_input_embeddings()
    out_head = hf.get_output_embeddings()
    tied = out_head.weight is table.weight
    with torch.no_grad():
        for name, mod in hf.named_modules():
            is_linear = isinstance(mod, torch.nn.Linear) or type(mod).__name__ == "Conv1D"
            if not is_linear or mod is out_head:
                continue
            w = mod.weight.double()
            w = w.t() if family == "gpt2" else w
            q = torch.from_numpy(ref_scheme(w.numpy(), weights)[0])
            mod.weight.copy_(q.t() if family == "gpt2" else q)
        src_table = table.weight.detach().clone().numpy()
        if tied:  # the engine's head and table part ways when they are stored differently
            out_head.weight = torch.nn.Parameter(table.weight.detach().clone())
        out_head.weight.copy_(torch.from_numpy(ref_scheme(out_head.weight.detach().numpy(), head_scheme)[0]))
        table.weight.copy_(torch.from_numpy(ref_table(src_table, emb)[0]))
    return hf


def _kld(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_model_logits_equal_transformers_with_reference_weights(sources, tmp_path, case, path):
    family, weights = case
    src = sources[family]
    model, _ = _quantized(src, weights, tmp_path)
    ref = _reference_model(src, family, weights)
    fp = AutoModelForCausalLM.from_pretrained(str(src), torch_dtype=torch.float64).eval()
    ids = torch.randint(2, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    meta = AttnMetadata(positions=torch.arange(ids.shape[1]).expand(2, -1))
    with torch.inference_mode():
        got = model(ids, meta).double()
        want = ref(ids).logits
        base = fp(ids).logits
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 2e-4 * scale + 1e-4
    k_ref, k_got = _kld(base, want), _kld(base, got)
    assert k_ref > 1e-6  # the scheme changes the model: a check that cannot see it would pass anything
    assert abs(k_got - k_ref) <= 0.02 * k_ref + 1e-7, (k_got, k_ref)  # from above and from below

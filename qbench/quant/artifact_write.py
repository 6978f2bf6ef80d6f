"""Writing a quantized artifact (the layout is described in qbench.quant.artifact, which loads it): the packed
tensors, the manifest and the copied config and tokenizer, from a model quantized in process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from qbench import __version__
from qbench.models.base import CausalLM
from qbench.models.weights import LazyTensors
from qbench.paths import sha256_file, tensors_sha256
from qbench.quant.artifact import FORMAT, MANIFEST, TOKENIZER_FILES, source_parameters
from qbench.quant.primitives import QTensor, pack_int4, storage_bytes


def split_rows(q: QTensor, parts: list[tuple[str, int]]) -> dict[str, QTensor]:
    """A fused QTensor -> one per Hugging Face projection (rows are independent, so this is exact)."""
    out, r = {}, 0
    for name, n in parts:
        rows = slice(r, r + n)
        out[name] = QTensor(q.bits, q.codes[rows], q.scale[rows], None if q.zero is None else q.zero[rows],
                            q.group_size, (n, q.shape[1]), q.activations, q.type, q.hadamard)
        r += n
    return out


def _held_linear_tensors(model: CausalLM, qtensors: dict[str, QTensor], names: set[str]) -> dict[str, torch.Tensor]:
    """Per Hugging Face projection: the bias of every linear, and the weight of every linear left in full
    precision, as the model holds them now, for the tensor ``names`` the source checkpoint has (a tied
    head has no weight of its own to write, and is not unpacked). A calibration pass folds scales into them
    (SmoothQuant divides Qwen2's v bias and the rows of an fp up projection), so the source checkpoint's
    copies are not what was quantized; written from the source, a smoothed Qwen2 artifact lost its v bias's
    division (KLD 10)."""
    out = {}
    conv1d = model.config.family == "gpt2"  # GPT-2's Conv1D stores weights (in, out)
    for path, parts in model.linear_map():
        mod = model.get_submodule(path)
        bias = getattr(mod, "bias", None)
        weight = None
        if path not in qtensors and hasattr(mod, "weight") and any(n + ".weight" in names for n, _ in parts):
            weight = mod.weight.detach()
        r = 0
        for name, n in parts:
            if bias is not None and name + ".bias" in names:
                out[name + ".bias"] = bias.detach()[r:r + n].float()
            if weight is not None and name + ".weight" in names:
                w = weight[r:r + n].float()
                out[name + ".weight"] = w.t() if conv1d else w
            r += n
    return out


def qtensor_tensors(name: str, q: QTensor) -> dict[str, torch.Tensor]:
    codes = q.codes.view(torch.float8_e4m3fn) if q.type == "float" else q.codes  # FP8 stored as F8_E4M3
    t = {f"{name}.qweight": (pack_int4(codes) if q.bits == 4 else codes).contiguous(),
         f"{name}.scales": q.scale.contiguous()}
    if q.zero is not None:
        t[f"{name}.zeros"] = q.zero.contiguous()
    return t


def tensor_scheme(q: QTensor) -> dict:
    """The integer scheme one stored tensor uses (recorded per tensor: a head may differ from the linears)."""
    scheme = {"bits": q.bits, "group_size": q.group_size, "symmetric": q.symmetric}
    if q.activations != "fp32":  # recorded only when set: weight-only artifacts stay byte for byte as before
        scheme["activations"] = q.activations
    if q.type != "int":
        scheme["type"] = q.type
    if q.hadamard:
        scheme["hadamard"] = q.hadamard
    return scheme


def _embedding_tensors(model: CausalLM, emb, tensors: dict, skip: set) -> dict:
    """Put the embedding table in ``tensors`` per its scheme -> the manifest's ``embedding`` record."""
    name = model.embed_hf
    if emb.scheme == "int8" and not emb.shared_with_head:
        tensors.update({f"{name}.qweight": emb.q.codes.contiguous(), f"{name}.scales": emb.q.scale.contiguous()})
    elif emb.table is not None:
        tensors[f"{name}.weight"] = emb.table.contiguous()
    if emb.scheme != "fp32":
        skip.add(f"{name}.weight")
    stored = ["lm_head.qweight", "lm_head.scales"] if emb.shared_with_head else sorted(
        k for k in tensors if k.startswith(name + "."))
    return {"scheme": emb.scheme, "shared_with_lm_head": emb.shared_with_head, "stored_as": stored,
            "bytes": sum(tensors[k].nbytes for k in stored if k in tensors)}


def save_artifact(model: CausalLM, source: Path, out_dir: Path, scheme: dict, qtensors: dict[str, QTensor],
                  manifest: dict, embedding=None) -> dict:
    """Write the artifact into ``out_dir`` (a fresh folder: the caller renames it into place)."""
    src = LazyTensors(source, torch.float32)
    tensors: dict[str, torch.Tensor] = {}
    quantized: dict[str, dict] = {}
    skip = set()
    for path, parts in model.linear_map():
        if path not in qtensors:
            continue
        for name, q in split_rows(qtensors[path], parts).items():
            tensors.update(qtensor_tensors(name, q))
            quantized[name] = {"shape": list(q.shape), "bytes": storage_bytes(q), "scheme": tensor_scheme(q)}
            skip.add(name + ".weight")
    emb_record = None if embedding is None else _embedding_tensors(model, embedding, tensors, skip)
    norms = {hf: model.get_submodule(path) for path, hf in model.norm_map().items()}
    bare_of = {key: key.split(".", 1)[1] if key.startswith(("model.", "transformer.")) and key not in skip else key
               for key in src.keys()}
    held = _held_linear_tensors(model, qtensors, set(bare_of) | set(bare_of.values()))
    for key, bare in bare_of.items():
        if key in skip or bare in skip:
            continue
        mine = held.get(key, held.get(bare))  # what the quantized model holds, in the source's orientation
        tensors[key] = (mine if mine is not None else src.get(key)).contiguous()
    for hf, norm in norms.items():  # AWQ may have rescaled these
        for key in (hf + ".weight", "transformer." + hf + ".weight"):
            if key in tensors:
                tensors[key] = norm.weight.detach().float().contiguous()
    q_bytes = sum(v["bytes"] for v in quantized.values())
    q_weights = sum(v["shape"][0] * v["shape"][1] for v in quantized.values())
    total = sum(t.nbytes for t in tensors.values())
    params = source_parameters(src)
    manifest = dict(manifest, format=FORMAT, scheme=scheme, quantized=quantized, embedding=emb_record, size={
        "artifact_tensor_bytes": total, "quantized_weight_bytes": q_bytes, "other_tensor_bytes": total - q_bytes,
        "parameters": params, "bits_per_weight_all": 8 * total / params,
        "quantized_weights": q_weights, "bits_per_weight": 8 * q_bytes / max(q_weights, 1),
    }, qbench_version=__version__)
    meta = {"format": FORMAT, "scheme": json.dumps(scheme, sort_keys=True), "quantized": json.dumps(sorted(quantized)),
            "schemes": json.dumps({k: v["scheme"] for k, v in sorted(quantized.items())}, sort_keys=True),
            "embedding": json.dumps(emb_record, sort_keys=True)}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata=meta)
    shutil.copy(source / "config.json", out_dir / "config.json")
    for f in TOKENIZER_FILES:
        if (source / f).is_file():
            shutil.copy(source / f, out_dir / f)
    # what loading checks: a flipped byte anywhere in the weights or config is refused, not run
    manifest["weights_sha256"] = tensors_sha256(out_dir / "model.safetensors")  # what eval and compare record
    manifest["files_sha256"] = {f.name: sha256_file(f) for f in sorted(out_dir.iterdir())
                                if f.is_file() and f.name != MANIFEST}
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest

"""`qbench export ARTIFACT --format compressed-tensors|native --out DIR`.

compressed-tensors ``pack-quantized`` (W4A16 / W8A16), as transformers and vLLM load it:
per linear ``weight_packed`` (int32, codes offset to unsigned and packed little-end first along the
input dimension: 8 per word at 4 bits, 4 per word at 8 bits), ``weight_scale``, ``weight_zero_point``
(asymmetric only, packed along the output dimension) and ``weight_shape``, with
``quantization_config`` in config.json. qbench's unsigned codes with the even index in the low
nibble are exactly those words read little-endian.

FP8 weights (``type: float``) go out in compressed-tensors' ``float-quantized`` format instead: ``weight`` as
F8_E4M3 (qbench's codes, byte for byte) and ``weight_scale`` (out, 1), with ``type: float`` in the config group.

compressed-tensors requires the input width to be a multiple of the group size. Where it is not
(SmolLM2's 576 with g128), the layer is exported at the largest group size that divides its width
(64 there) with each scale repeated across the sub-groups of a group, which dequantizes to the
same weights bit for bit; its config group records the group size actually used.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from qbench.errors import QBenchError
from qbench.models.weights import LazyTensors
from qbench.paths import MARKER, atomic_dir, check_output
from qbench.quant.artifact import MANIFEST, TOKENIZER_FILES, QuantFactory, read_manifest, verify_files
from qbench.quant.primitives import QTensor

FORMATS = ("compressed-tensors", "native")


def _pack_words(u: torch.Tensor, bits: int) -> torch.Tensor:
    """(R, C) unsigned codes -> (R, ceil(C * bits / 32)) int32, element i at bit (i * bits) % 32."""
    per = 32 // bits
    R, C = u.shape
    pad = (-C) % per
    u = torch.nn.functional.pad(u.to(torch.int64), (0, pad)).view(R, -1, per)
    shifts = torch.arange(per, dtype=torch.int64) * bits
    words = (u << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same bits, signed


def export_group(k: int, group: int) -> int:
    g = group
    while k % g:
        g //= 2
    return g


def ct_tensors(name: str, q: QTensor) -> tuple[dict[str, torch.Tensor], int | None]:
    """compressed-tensors tensors for one projection, and the group size they use."""
    N, K = q.shape
    if q.type == "float":  # float-quantized: the e4m3 bytes as they are, one fp32 scale per output channel
        return {f"{name}.weight": q.codes.view(torch.float8_e4m3fn).contiguous(),
                f"{name}.weight_scale": q.scale.float()[:, None].contiguous()}, None
    if q.bits == 8:
        u = (q.codes.to(torch.int16) + 128).to(torch.uint8)
        t = {f"{name}.weight_packed": _pack_words(u, 8), f"{name}.weight_scale": q.scale.float()[:, None]}
        t[f"{name}.weight_shape"] = torch.tensor([N, K], dtype=torch.int64)
        return t, None
    g = export_group(K, q.group_size)
    rep = q.group_size // g
    n_sub = K // g
    scale = q.scale.float().repeat_interleave(rep, dim=1)[:, :n_sub]
    t = {f"{name}.weight_packed": _pack_words(q.codes[:, :K], 4), f"{name}.weight_scale": scale.contiguous(),
         f"{name}.weight_shape": torch.tensor([N, K], dtype=torch.int64)}
    if q.zero is not None:
        zero = q.zero.repeat_interleave(rep, dim=1)[:, :n_sub]
        t[f"{name}.weight_zero_point"] = _pack_words(zero.t().contiguous(), 4).t().contiguous()
    return t, g


def run_export(artifact: Path, fmt: str, out: Path, force: bool = False) -> Path:
    artifact, out = Path(artifact), Path(out)
    if fmt not in FORMATS:
        raise QBenchError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if not (artifact / MANIFEST).is_file():
        raise QBenchError(f"{artifact}: not a qbench artifact (no {MANIFEST}); make one with `qbench quantize`")
    check_output(out, "export", force)
    manifest = read_manifest(artifact)
    verify_files(artifact, manifest)
    if fmt == "native":
        with atomic_dir(out, "export", force) as tmp:
            for f in artifact.iterdir():
                if f.is_file() and f.name != MARKER:
                    shutil.copy(f, tmp / f.name)
        return out
    scheme = manifest.get("scheme")
    if scheme is None:
        raise QBenchError(f"{artifact}: has no quantized weights; compressed-tensors export needs a weight scheme")
    emb = (manifest.get("embedding") or {}).get("scheme", "fp32")
    if emb == "int8":
        raise QBenchError(f"{artifact}: its embedding table is INT8, which compressed-tensors' pack-quantized "
                          f"format (linear layers only) cannot hold; export a recipe with embedding fp32, fp16 or "
                          f"bf16, or use --format native")
    rotated = sorted(n for n, info in manifest["quantized"].items() if (info.get("scheme") or {}).get("hadamard"))
    if rotated:
        raise QBenchError(f"{artifact}: {rotated[0]} (and {len(rotated) - 1} more) holds W H / b for inputs rotated "
                          f"online by a Hadamard transform, which compressed-tensors' pack-quantized layout does not "
                          f"describe; export a recipe without weights.hadamard, or use --format native")
    if any((info.get("scheme") or {}).get("activations", "fp32") != "fp32" for info in manifest["quantized"].values()):
        raise QBenchError(f"{artifact}: its linears take INT8 activations (W4A8 or W8A8), which this export would "
                          f"not reproduce: compressed-tensors rounds dynamic per-token INT8 on a grid of absmax / "
                          f"127.5 (qbench: absmax / 127); export the weight-only recipe with the same codes "
                          f"(w4g64-head for w4a8g64, w8 for w8a8), or use --format native")
    src = LazyTensors(artifact, torch.float32)  # an fp16 / bf16 table is written as float32, as transformers loads it
    factory = QuantFactory(scheme, manifest["quantized"], str(artifact))
    tensors: dict[str, torch.Tensor] = {}
    groups: dict[tuple, list[str]] = {}  # (type, bits, symmetric, group size) -> tensors: an INT8 head is its own
    from qbench.models.weights import Weights
    w = Weights(src, str(artifact))
    for name, info in manifest["quantized"].items():
        n, k = info["shape"]
        q = factory.qtensor(w, name, n, k)
        t, g = ct_tensors(name, q)
        tensors.update(t)
        groups.setdefault((q.type, q.bits, q.symmetric, g), []).append(name)
    if len({key[0] for key in groups}) > 1:  # one format per checkpoint: pack-quantized or float-quantized
        raise QBenchError(f"{artifact}: it mixes FP8 and integer weights, which one compressed-tensors checkpoint "
                          f"(one format) cannot hold; quantize every linear as FP8 or none, or use --format native")
    fmt_name = "float-quantized" if next(iter(groups))[0] == "float" else "pack-quantized"
    skip = tuple(f"{n}.{s}" for n in manifest["quantized"] for s in ("qweight", "scales", "zeros"))
    for key in src.keys():
        if key not in skip:
            tensors[key] = src.get(key).contiguous()
    config = json.loads((artifact / "config.json").read_text())
    config_groups = {}
    for i, ((kind, bits, sym, g), names) in enumerate(sorted(groups.items(),
                                                             key=lambda kv: (kv[0][1], -(kv[0][3] or 0)))):
        weights = {"num_bits": bits, "type": kind, "symmetric": sym,
                   "strategy": "channel" if g is None else "group", "group_size": g, "dynamic": False,
                   "observer": "minmax", "actorder": None}
        config_groups[f"group_{i}"] = {"targets": sorted(names), "weights": weights, "input_activations": None,
                                       "output_activations": None}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": fmt_name, "quantization_status": "compressed",
        "config_groups": config_groups, "ignore": ["lm_head"] if "lm_head" not in manifest["quantized"] else [],
        "kv_cache_scheme": None, "global_compression_ratio": None,
    }
    with atomic_dir(out, "export", force) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for f in TOKENIZER_FILES:
            if (artifact / f).is_file():
                shutil.copy(artifact / f, tmp / f)
    return out

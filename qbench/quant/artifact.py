"""The quantized artifact: a self-describing folder that qbench's engine loads.

    DIR/model.safetensors  packed integer weights + fp tensors, Hugging Face tensor names
    DIR/config.json        the source model's config
    DIR/tokenizer*         the source tokenizer
    DIR/qbench.json        the manifest: recipe, source sha256, versions, seed, sizes, per-layer errors, and
                           the sha256 of every other file, checked on every load

A quantized projection NAME is stored as NAME.qweight (INT4: uint8 (N, K_pad/2), two codes per byte,
even index in the low nibble; INT8: int8 (N, K)), NAME.scales (fp16) and NAME.zeros (uint8, asymmetric
only). The scheme is recorded in the manifest and in the safetensors metadata, never read from a name.
This module reads and checks an artifact; qbench.quant.artifact_write writes one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from qbench.errors import QBenchError
from qbench.inputs import read_json_object
from qbench.models.base import CausalLM
from qbench.models.config import ModelConfig
from qbench.models.weights import LazyTensors, Weights, read_header
from qbench.paths import sha256_file
from qbench.quant.primitives import QTensor, padded_width, scheme_fits, unpack_int4
from qbench.quant.qlinear import make_qlinear

FORMAT = "qbench-quant/1"
MANIFEST = "qbench.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model")


def is_artifact(folder: Path) -> bool:
    return (Path(folder) / MANIFEST).is_file()


def verify_files(folder: Path, manifest: dict) -> None:
    """Every file the artifact's manifest lists has the sha256 recorded when it was written."""
    recorded = manifest.get("files_sha256")
    if not isinstance(recorded, dict) or "model.safetensors" not in recorded:
        raise QBenchError(f"{folder}: {MANIFEST} records no file hashes (an artifact from an older qbench), so its "
                          f"weights cannot be verified; re-create it with `qbench quantize`")
    for name, digest in sorted(recorded.items()):
        path = Path(folder) / name
        if not path.is_file():
            raise QBenchError(f"{path}: missing, but {MANIFEST} lists it; re-create the artifact")
        if sha256_file(path) != digest:
            raise QBenchError(f"{path}: its sha256 is not the one {MANIFEST} recorded: the file was changed or "
                              f"damaged after qbench wrote it; re-create the artifact")


def source_parameters(src: LazyTensors) -> int:
    """The source model's weights, a tied table counted once (it is one tensor there): llama.cpp's
    bits-per-weight denominator."""
    return sum(math.prod(info["shape"]) for _, info, _ in src.where.values())


def read_manifest(folder: Path) -> dict:
    path = Path(folder) / MANIFEST
    m = read_json_object(path, "artifact manifest")
    if m.get("format") != FORMAT:
        raise QBenchError(f"{path}: format {m.get('format')!r} is not {FORMAT!r}; re-create the artifact")
    shapes = {"scheme": (dict, type(None)), "quantized": (dict,), "kv": (dict, type(None)),
              "embedding": (dict, type(None)), "files_sha256": (dict,), "recipe": (dict,)}
    for key, types in shapes.items():
        if key in m and not isinstance(m[key], types):
            raise QBenchError(f"{path}: {key} is a {type(m[key]).__name__}, which qbench never writes there; the "
                              f"manifest was edited or damaged: re-create the artifact")
    for name, info in m.get("quantized", {}).items():
        shape = info.get("shape") if isinstance(info, dict) else None
        if not (isinstance(shape, list) and len(shape) == 2 and all(type(x) is int and x > 0 for x in shape)):
            raise QBenchError(f"{path}: quantized.{name} has no [N, K] shape; the manifest was edited or damaged: "
                              f"re-create the artifact")
    return m


def expected_shapes(scheme: dict, n: int, k: int) -> dict[str, tuple[int, ...]]:
    """The stored tensors of one quantized projection (N, K) under ``scheme``."""
    bits, group = scheme["bits"], scheme.get("group_size")
    if bits == 8:
        return {".qweight": (n, k), ".scales": (n,)}
    kp = padded_width(k, group)
    out = {".qweight": (n, kp // 2), ".scales": (n, kp // group)}
    if not scheme["symmetric"]:
        out[".zeros"] = (n, kp // group)
    return out


def scheme_of(manifest_scheme: dict | None, info: dict) -> dict:
    """One quantized tensor's scheme: its own record, or (artifacts written before per-tensor records) the
    artifact's."""
    return info.get("scheme") or manifest_scheme


class QuantFactory:
    """Builds QuantLinear modules for the projections an artifact stores quantized, and its embedding table."""

    def __init__(self, scheme: dict, quantized: dict[str, dict], where: str, embedding: dict | None = None):
        self.scheme, self.quantized, self.where, self.emb = scheme, quantized, where, embedding

    def embedding(self, w: Weights, name: str, shape: tuple[int, int], out_dtype: torch.dtype):
        from qbench.layers.embedding import Embedding
        from qbench.quant.qembedding import Int8Embedding
        scheme = (self.emb or {}).get("scheme", "fp32")
        V, H = shape
        if scheme == "int8":
            codes, scales = w.get(name + ".qweight", (V, H)), w.get(name + ".scales", (V,))
            if codes.dtype != torch.int8:
                raise QBenchError(f"{self.where}: {name}.qweight is {codes.dtype}, the manifest says INT8; "
                                  f"re-create the artifact")
            return Int8Embedding(QTensor(8, codes, scales.half(), None, None, (V, H)), out_dtype)
        return Embedding(w.get(name + ".weight", shape, keep_dtype=scheme != "fp32", mapped=True), out_dtype)

    def is_quantized(self, w: Weights, name: str) -> bool:
        return self._key(w, name) is not None

    def _key(self, w: Weights, name: str) -> str | None:
        for k in (w.prefix + name, name):
            if k in self.quantized:
                return k
        return None

    def qtensor(self, w: Weights, key: str, n: int, k: int) -> QTensor:
        scheme = scheme_of(self.scheme, self.quantized[key])
        bits, group, sym = scheme["bits"], scheme.get("group_size"), scheme["symmetric"]
        got = {}
        for suffix, shape in expected_shapes(scheme, n, k).items():
            t = w.tensors.get(key + suffix, keep_dtype=True)
            if t is None or tuple(t.shape) != shape:
                raise QBenchError(f"{self.where}: the manifest's {bits}-bit scheme needs {key + suffix} of shape "
                                  f"{shape}, the tensors have {None if t is None else tuple(t.shape)}; the manifest "
                                  f"does not match the weights: re-create the artifact")
            got[suffix] = t
        acts, kind = scheme.get("activations", "fp32"), scheme.get("type", "int")
        if not scheme_fits(bits, acts, kind):
            raise QBenchError(f"{self.where}: {MANIFEST} gives {key} {kind} {bits}-bit weights with {acts!r} "
                              f"activations, which qbench never writes; the manifest was edited or damaged: "
                              f"re-create the artifact")
        stored = got[".qweight"].dtype
        if (stored == torch.float8_e4m3fn) != (kind == "float"):
            raise QBenchError(f"{self.where}: {key}.qweight is {stored}, the manifest says {kind} {bits}-bit; "
                              f"re-create the artifact")
        rot = scheme.get("hadamard", 0)
        if rot and (type(rot) is not int or rot < 2 or rot & (rot - 1) or k % rot or kind != "int"):
            raise QBenchError(f"{self.where}: {MANIFEST} gives {key} a Hadamard rotation of {rot!r} on {k} inputs, "
                              f"which qbench never writes (a power of two dividing the inputs, integer codes); "
                              f"the manifest was edited or damaged: re-create the artifact")
        if kind == "float":  # the loader has checked the codes are finite (no e4m3 NaN byte)
            codes = got[".qweight"].view(torch.uint8)
        else:
            codes = unpack_int4(got[".qweight"]) if bits == 4 else got[".qweight"].to(torch.int8)
        return QTensor(bits, codes, got[".scales"].half(), got[".zeros"].to(torch.uint8) if not sym else None,
                       group if bits == 4 else None, (n, k), acts, kind, rot)

    def __call__(self, w: Weights, names: list[str], shapes: list[tuple[int, int]], conv1d: bool = False):
        keys = [self._key(w, n) for n in names]
        if all(k is None for k in keys):
            from qbench.models.weights import dense_linear
            return dense_linear(w, names, shapes, conv1d)
        if any(k is None for k in keys):
            raise QBenchError(f"{self.where}: {names} are fused at run time but only some are quantized")
        qs = [self.qtensor(w, key, n, k) for key, (n, k) in zip(keys, shapes)]
        if len({(x.bits, x.group_size, x.symmetric, x.activations, x.type, x.hadamard) for x in qs}) > 1:
            raise QBenchError(f"{self.where}: {names} are fused at run time but stored under different schemes")
        q = qs[0] if len(qs) == 1 else QTensor(
            qs[0].bits, torch.cat([x.codes for x in qs]), torch.cat([x.scale for x in qs]),
            None if qs[0].zero is None else torch.cat([x.zero for x in qs]), qs[0].group_size,
            (sum(x.shape[0] for x in qs), qs[0].shape[1]), qs[0].activations, qs[0].type, qs[0].hadamard)
        biases = [w.maybe(n + ".bias") for n in names]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else torch.zeros(s[0]) for b, s in zip(biases, shapes)])
        return make_qlinear(q, bias)


def artifact_kv_scheme(manifest: dict, where: str):
    """The KV-cache scheme an artifact's manifest records, or None for a full-precision cache."""
    from qbench.quant.recipe import kv_from_dict
    kv = manifest.get("kv")
    if kv is None:
        return None
    return kv_from_dict({k: v for k, v in kv.items() if k != "memory"}, f"{where}/{MANIFEST}")


def load_artifact(folder: Path, dtype: torch.dtype = torch.float32, shard=None) -> tuple[CausalLM, dict]:
    from qbench.models.registry import load_model

    folder = Path(folder)
    manifest = read_manifest(folder)
    verify_files(folder, manifest)
    header, _ = read_header(folder / "model.safetensors")
    meta = header.get("__metadata__") or {}
    if meta.get("format") != FORMAT or json.loads(meta.get("scheme", "null")) != manifest.get("scheme"):
        raise QBenchError(f"{folder}: the safetensors metadata does not match {MANIFEST} (scheme or format "
                          f"differ); re-create the artifact with `qbench quantize`")
    listed = set(json.loads(meta.get("quantized", "[]")))
    if listed != set(manifest.get("quantized", {})):
        raise QBenchError(f"{folder}: {MANIFEST} and model.safetensors list different quantized tensors; "
                          f"re-create the artifact")
    scheme = manifest["scheme"]
    recorded = {k: v["scheme"] for k, v in manifest.get("quantized", {}).items() if "scheme" in v}
    if "schemes" in meta and json.loads(meta["schemes"]) != recorded or \
            "embedding" in meta and json.loads(meta["embedding"]) != manifest.get("embedding"):
        raise QBenchError(f"{folder}: {MANIFEST} and model.safetensors record different per-tensor schemes; "
                          f"re-create the artifact")
    for name, info in manifest.get("quantized", {}).items():
        n, k = info["shape"]
        for suffix, shape in expected_shapes(scheme_of(scheme, info), n, k).items():
            got = header.get(name + suffix, {}).get("shape")
            if got is None or tuple(got) != shape:
                raise QBenchError(f"{folder}: {MANIFEST} says {name} is {n}x{k} ({scheme['bits']}-bit), so "
                                  f"{name + suffix} should be {shape}, but the tensors have {got}; the manifest "
                                  f"does not match the weights: re-create the artifact")
    ModelConfig.from_folder(folder)
    if shard is not None:
        rotated = sorted(n for n, info in manifest.get("quantized", {}).items() if scheme_of(scheme, info).get("hadamard"))
        if rotated:
            raise QBenchError(f"tensor parallel: {folder} rotates the inputs of {rotated[0]} online (weights.hadamard), "
                              f"and a rank's slice of a row-parallel input need not hold whole rotation blocks; run it "
                              f"in one process")
        layer_schemes = {json.dumps(scheme_of(scheme, info), sort_keys=True)
                         for name, info in manifest.get("quantized", {}).items() if not name.startswith("lm_head")}
        if len(layer_schemes) > 1:
            raise QBenchError(f"tensor parallel: {folder} mixes weight schemes across its decoder linears (a recipe's "
                              f"weights.overrides), and the shards are cut by one scheme's groups; run it in one "
                              f"process, or quantize with one scheme")
    factory = QuantFactory(manifest["scheme"], manifest.get("quantized", {}), str(folder), manifest.get("embedding"))
    tensors = LazyTensors(folder, dtype)
    model = load_model(folder, dtype, tensors=tensors, factory=factory,
                       shard=None if shard is None else lambda cfg, t: shard(cfg, t, scheme))
    return model, manifest

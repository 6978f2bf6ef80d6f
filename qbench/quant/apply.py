"""Quantize a loaded qbench model with a recipe, block by block.

RTN needs no data. AWQ and GPTQ run the calibration windows through the model one block at a
time: the block's linear inputs are captured, the block is quantized, and its quantized output
becomes the next block's input (llm-compressor's sequential pipeline). All of it runs in float64
on a widened copy of each block in turn (wide.py), so the artifact does not depend on the machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from qbench import heap
from qbench.errors import QBenchError
from qbench.layers.embedding import Embedding
from qbench.models.base import CausalLM
from qbench.quant import awq, block_scales, gptq, hadamard, wide
from qbench.quant.passes import block_forward, capture, progress
from qbench.quant.primitives import QTensor, dequantize, fake_quantize_activations, quantize_fp8, quantize_int4, \
    quantize_int8
from qbench.quant.qembedding import Int8Embedding
from qbench.quant.qlinear import make_qlinear
from qbench.quant.recipe import Recipe


@dataclass
class EmbeddingResult:
    scheme: str  # fp32, fp16, bf16 or int8
    shared_with_head: bool = False  # a tied model's INT8 table that is also its INT8 head: one stored tensor
    q: QTensor | None = None  # int8
    table: torch.Tensor | None = None  # fp16 / bf16


@dataclass
class QuantResult:
    qtensors: dict[str, QTensor] = field(default_factory=dict)  # module path -> quantized weight
    layers: list[dict] = field(default_factory=list)  # per-layer error records
    seconds: float = 0.0
    embedding: EmbeddingResult | None = None


def _get(model: torch.nn.Module, path: str) -> torch.nn.Module:
    return model.get_submodule(path)


def targets(model: CausalLM, recipe: Recipe) -> list[str]:
    ws = recipe.weights
    out = []
    for path, _ in model.linear_map():
        if path == "lm_head" and ws.head_scheme() is None:
            continue
        if any(s in path for s in ws.skip):
            continue
        if path != "lm_head" and ws.linear_scheme(path) is None:  # an fp override
            continue
        out.append(path)
    return out


def rtn(W: torch.Tensor, bits: int, group: int | None, symmetric: bool, type: str = "int") -> QTensor:
    if type == "float":
        return quantize_fp8(W)
    return quantize_int8(W) if bits == 8 else quantize_int4(W, group, symmetric)


def _record(path: str, W: torch.Tensor, q: QTensor, X: torch.Tensor | None, H: torch.Tensor | None = None,
            tokens: int = 0) -> dict:
    """The error record of one quantized linear: the weights' relative error and, given its calibration inputs,
    the output's relative error against the fp layer. With fp activations and the inputs' Hessian H = mean x x^T
    over ``tokens`` tokens (GPTQ has it), the output's is sqrt(tr(D H D^T) / tr(W H W^T)) for D the weight error:
    every calibration token at N K^2 instead of two products with the token subsample."""
    dq = dequantize(q).to(W.dtype)
    rec = {"module": path, "shape": list(W.shape), "weight_rel_error": ((dq - W).norm() / W.norm()).item()}
    if H is not None and q.activations != "int8":
        D = dq - W
        rec["output_rel_error"] = (gptq.quadratic_trace(D, H) / gptq.quadratic_trace(W, H)).sqrt().item()
        rec["output_error_tokens"] = tokens
    elif X is not None:  # against the fp layer: with int8 activations, their rounding counts too
        ref = X @ W.t()
        Xq = fake_quantize_activations(X).to(X.dtype) if q.activations == "int8" else X
        rec["output_rel_error"] = ((Xq @ dq.t() - ref).norm() / ref.norm()).item()
        rec["output_error_tokens"] = X.shape[0]
    return rec


def _keep(path: str, q: QTensor, W: torch.Tensor, X: torch.Tensor | None, res: QuantResult,
          activations: str, H: torch.Tensor | None = None, tokens: int = 0) -> None:
    """Add the quantized weight of the linear at ``path`` to the result, with its error record."""
    q.activations = activations
    res.qtensors[path] = q
    res.layers.append(_record(path, W, q, X, H, tokens))


def _replace(model: CausalLM, path: str, q: QTensor, W: torch.Tensor, X: torch.Tensor | None,
             res: QuantResult, activations: str = "fp32") -> None:
    """Swap the linear at ``path`` for its quantized module and record its error."""
    _keep(path, q, W, X, res, activations)
    model.set_submodule(path, make_qlinear(q, _get(model, path).bias))


def _rotation(model: CausalLM, recipe: Recipe, path: str) -> int:
    """The Hadamard block of the decoder linear ``path``'s online rotation, 0 for none."""
    if path == "lm_head" or not recipe.weights.linear_hadamard(path):
        return 0
    return hadamard.block_for(_get(model, path).weight.shape[1])


def _head_scheme(model: CausalLM, recipe: Recipe) -> tuple | None:
    """The head's (bits, group, symmetric) when this recipe quantizes it (a skip list can keep it fp)."""
    return recipe.weights.head_scheme() if "lm_head" in targets(model, recipe) else None


def _head_rtn(model: CausalLM, recipe: Recipe, res: QuantResult) -> None:
    """The output head, round to nearest under its own scheme (no calibration inputs are captured for it)."""
    W = model.lm_head.weight.float()
    _replace(model, "lm_head", rtn(W, *recipe.weights.head_scheme()), W, None, res, recipe.weights.activations)


def quantize_embedding(model: CausalLM, recipe: Recipe, res: QuantResult) -> None:
    """Store the token embedding table per ``weights.embedding``; untie it from a head about to be quantized.

    A tied model whose head and table are both INT8 per row keeps one tensor: the head's codes serve the
    lookups (QuantLinear.rows). A tied model whose head stays fp cannot store its table otherwise: the table
    is the head."""
    ws = recipe.weights
    table = model.embedding_table()  # (V, H)
    tied = getattr(model, model.embed_attr) is None
    head = _head_scheme(model, recipe)
    out = EmbeddingResult(ws.embedding,
                          shared_with_head=tied and ws.embedding == "int8" and head == (8, None, True, "int"))
    module, stored = None, table
    if ws.embedding == "int8":
        out.q = quantize_int8(table)
        stored = dequantize(out.q)
        module = None if out.shared_with_head else Int8Embedding(out.q, model.dtype)
    elif ws.embedding in ("fp16", "bf16"):
        out.table = table.to(torch.float16 if ws.embedding == "fp16" else torch.bfloat16)
        stored = out.table.float()
        module = Embedding(out.table, model.dtype)
    elif tied and head is not None:
        module = Embedding(table.clone(), model.dtype)  # the table stays fp32 apart from the quantized head
    if module is not None:
        model.untie(module)
    res.embedding = out
    res.layers.append({"module": "embedding", "shape": list(table.shape), "scheme": ws.embedding,
                       "shared_with_lm_head": out.shared_with_head,
                       "weight_rel_error": ((stored - table).norm() / table.norm()).item()})


def check_recipe(model: CausalLM, recipe: Recipe) -> None:
    """What a recipe asks that this model cannot take, refused before any work."""
    ws = recipe.weights
    from fnmatch import fnmatchcase
    names = [p for p, _ in model.linear_map() if p != "lm_head"]
    for i, o in enumerate(ws.overrides):
        if not any(fnmatchcase(n, o.match) for n in names):
            raise QBenchError(f"recipe {recipe.name}: weights.overrides[{i}].match: {o.match!r} matches no linear of "
                              f"this model; its linears are named like {names[0]}, {names[-1]} "
                              f"(the head is set by weights.lm_head)")
    if ws.method == "awq" and model.config.family != "llama":
        raise QBenchError(f"AWQ is implemented for the Llama family; {model.config.model_type} is not; use rtn or gptq")
    if recipe.smoothquant is not None and model.config.family != "llama":
        raise QBenchError(f"recipe {recipe.name}: SmoothQuant is implemented for the Llama family (its scales fold "
                          f"into RMSNorm weights); {model.config.model_type} is not; drop the smoothquant section")
    if getattr(model, model.embed_attr) is None and _head_scheme(model, recipe) is None and ws.embedding != "fp32":
        raise QBenchError(f"recipe {recipe.name}: weights.embedding: {ws.embedding} on a model with tied embeddings "
                          f"would change its output head too; quantize the head as well (weights.lm_head) or "
                          f"keep the embedding fp32")
    for p in targets(model, recipe):
        if recipe.weights.linear_hadamard(p) and p != "lm_head" and _rotation(model, recipe, p) == 0:
            k = _get(model, p).weight.shape[1]
            raise QBenchError(f"recipe {recipe.name}: weights.hadamard: {p} has {k} inputs, which no power-of-two "
                              f"block of {hadamard.MIN_BLOCK} to {hadamard.MAX_BLOCK} divides; leave it unrotated")


def quantize_model(model: CausalLM, recipe: Recipe, calib: torch.Tensor | None, log=print) -> QuantResult:
    """Quantize ``model`` in place per ``recipe`` (swapping in QuantLinear modules)."""
    ws = recipe.weights
    check_recipe(model, recipe)
    t0 = time.perf_counter()
    res = QuantResult()
    todo = targets(model, recipe)
    quantize_embedding(model, recipe, res)
    if not recipe.needs_calibration:
        for path in todo:
            if path == "lm_head":
                _head_rtn(model, recipe, res)
                continue
            W = _get(model, path).weight.float()
            rot = _rotation(model, recipe, path)
            if rot:
                W = hadamard.rotate_weight(W, rot)
            q = rtn(W, *ws.linear_scheme(path))
            q.hadamard = rot
            _replace(model, path, q, W, None, res, ws.linear_activations(path))
        res.seconds = time.perf_counter() - t0
        return res
    if calib is None:
        raise QBenchError(f"recipe {recipe.name}: {ws.method}"
                          f"{' with smoothquant' if recipe.smoothquant else ''} needs calibration data")
    with torch.inference_mode(), heap.calibration_heap():
        positions = torch.arange(calib.shape[1]).expand_as(calib)
        x = model.embed(calib, positions).to(wide.WIDE)  # (S, T, H); the calibration runs in float64: see wide.py
        t_blocks = time.perf_counter()
        for bi, block in enumerate(model.blocks):
            prefix = f"blocks.{bi}."
            names = [p for p in todo if p.startswith(prefix)]
            local = [n[len(prefix):] for n in names]  # as the block names them: qkv, o_proj, ...
            wide.widen(block)
            inputs = capture(model.config, block, x, local, recipe.awq.max_tokens,
                             hessian=ws.method == "gptq", maxima=recipe.smoothquant is not None)
            clips = {}
            if ws.method == "awq":
                block_scales.awq_block(model, block, bi, inputs, recipe, res)
                if recipe.awq.clip:
                    clips = block_scales.awq_clip_block(block, bi, local, inputs, recipe, res)
            if recipe.smoothquant is not None:
                block_scales.smoothquant_block(model, block, bi, inputs, recipe, res)
            for name in names:
                local_name = name[len(prefix):]
                W = _get(model, name).weight  # (N, K) float64, with any scales folded in
                bits, group, sym, kind = ws.linear_scheme(name)
                rot = _rotation(model, recipe, name)
                if rot:  # quantized as W H / b against inputs x H, which the widened linear will compute
                    W = hadamard.rotate_weight(W, rot)
                    inputs[local_name] = hadamard.fwht(inputs[local_name], rot)
                    if "H:" + local_name in inputs:
                        inputs["H:" + local_name] = hadamard.rotate_hessian(inputs["H:" + local_name], rot)
                if ws.method == "gptq":
                    H = inputs["H:" + local_name]
                    q = gptq.gptq_quantize(W, H, bits, group, sym, recipe.gptq.damp,
                                           recipe.gptq.block_size, recipe.gptq.act_order)
                else:
                    clip = clips.get(local_name)
                    Wc = W if clip is None else awq.apply_clip(W, clip, group if bits == 4 else None)
                    q = rtn(Wc, bits, group, sym, kind)
                q.hadamard = rot
                _keep(name, q, W, inputs[local_name], res, ws.linear_activations(name), inputs.get("H:" + local_name),
                      inputs.get("n:" + local_name, 0))
                _get(model, name).quantized(q)  # the widened block computes with the dequantized weights
            x = block_forward(model.config, block, x)  # the quantized block's output feeds the next block
            wide.narrow(block)
            log(progress(bi + 1, len(model.blocks), time.perf_counter() - t_blocks,
                         ws.method + (" + smoothquant" if recipe.smoothquant else "")))
        if "lm_head" in todo:
            _head_rtn(model, recipe, res)
    res.seconds = time.perf_counter() - t0
    return res

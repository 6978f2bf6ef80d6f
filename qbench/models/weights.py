"""Reading a Hugging Face folder's safetensors into plain tensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qbench.errors import QBenchError


def weight_files(folder: Path) -> list[Path]:
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise QBenchError(f"{index}: malformed shard index ({e}); re-create the model folder") from None
        files = [folder / n for n in names]
    else:
        files = [folder / "model.safetensors"]
    for f in files:
        if not f.is_file():
            raise QBenchError(f"{folder}: missing weight file {f.name}; the folder needs model.safetensors "
                              f"(or its shards); re-create it or run `qbench pull`")
    return files


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn}


def read_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (name -> dtype/shape/offsets, plus __metadata__) and data start."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
            if n <= 1 or 8 + n > size:
                raise ValueError("bad header length")
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise QBenchError(f"{path}: not a safetensors file ({e}); re-create it") from None
    if not isinstance(header, dict):
        raise QBenchError(f"{path}: not a safetensors file (header is not a JSON object); re-create it")
    data_len = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            b, e = info["data_offsets"]
            dt = _DTYPES[info["dtype"]]
            count = 1
            for d in info["shape"]:
                count *= int(d)
            ok = 0 <= b <= e <= data_len and e - b == count * torch.empty(0, dtype=dt).element_size()
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise QBenchError(f"{path}: tensor {name!r} has a corrupt entry (dtype, shape or offsets do not fit "
                              f"the file); re-create it")
    return header, 8 + n


def all_finite(t: torch.Tensor, chunk: int = 1 << 20) -> bool:
    """No NaN or infinity in ``t``, checked a chunk at a time: ``isfinite`` over a whole embedding table
    makes temporaries of up to twice its size (+192 MiB of peak RSS on SmolLM2's 108 MiB table)."""
    flat = t.reshape(-1)
    widen = flat.dtype.itemsize == 1  # FP8: torch has no isfinite for it; its values are exact in fp32
    return all(bool(torch.isfinite(flat[i:i + chunk].float() if widen else flat[i:i + chunk]).all())
               for i in range(0, flat.numel(), chunk))


def _not_finite(f: Path, name: str):
    # a NaN scale or weight does not crash: it silently generates garbage (token 0 repeated)
    raise QBenchError(f"{f}: tensor {name!r} holds NaN or infinite values; the file is damaged, or the "
                      f"model that made it diverged: re-create it")


class LazyTensors:
    """A read-only mapping name -> tensor over safetensors files, read on access.

    Tensors are read with plain file reads, one at a time: each is converted (fused,
    transposed, packed) and the original freed before the next, so peak memory stays near
    the model's final size. The exception is a tensor asked for ``mapped`` (an embedding
    table that needs no conversion), which stays a memory map of the file.
    """

    def __init__(self, folder: Path, dtype: torch.dtype):
        self.dtype = dtype
        self.where: dict[str, tuple[Path, dict, int]] = {}
        for f in weight_files(folder):
            header, start = read_header(f)
            for name, info in header.items():
                if name != "__metadata__":
                    self.where[name] = (f, info, start)

    def _mapped(self, name: str, chunk: int = 1 << 22) -> torch.Tensor:
        import numpy as np

        f, info, start = self.where[name]
        b, e = info["data_offsets"]
        dt = _DTYPES[info["dtype"]]
        if dt.is_floating_point:
            buf = torch.empty(chunk, dtype=torch.uint8)  # chunk is a multiple of every element size
            with open(f, "rb") as fh:
                fh.seek(start + b)
                for at in range(b, e, chunk):
                    n = min(chunk, e - at)
                    if fh.readinto(memoryview(buf.numpy())[:n]) != n:
                        raise QBenchError(f"{f}: tensor {name!r} is truncated; re-create the file")
                    if not all_finite(buf[:n].view(dt)):
                        _not_finite(f, name)
        raw = np.memmap(f, dtype=np.uint8, mode="c", offset=start + b, shape=(e - b,))
        return torch.from_numpy(raw).view(dt).reshape(info["shape"])

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def keys(self):
        return self.where.keys()

    def get(self, name: str, default=None, keep_dtype: bool = False, mapped: bool = False):
        """The tensor, floats converted to this mapping's dtype unless ``keep_dtype`` (an fp16 table stays fp16).

        ``mapped``: a tensor that needs no conversion is returned as a private (copy-on-write) memory map of
        the file, checked first by reading it through a small buffer, so only the pages later touched become
        resident: an embedding table, of which a step reads one row per token, as llama.cpp maps its file."""
        if name not in self.where:
            return default
        f, info, start = self.where[name]
        b, e = info["data_offsets"]
        dt = _DTYPES[info["dtype"]]
        if mapped and e > b and (not dt.is_floating_point or keep_dtype or dt == self.dtype) \
                and (start + b) % dt.itemsize == 0:
            return self._mapped(name)
        buf = torch.empty(e - b, dtype=torch.uint8)
        with open(f, "rb") as fh:
            fh.seek(start + b)
            if fh.readinto(memoryview(buf.numpy())) != e - b:
                raise QBenchError(f"{f}: tensor {name!r} is truncated; re-create the file")
        t = buf.view(dt).reshape(info["shape"])
        if t.is_floating_point() and not all_finite(t):
            _not_finite(f, name)
        return t.to(self.dtype) if t.is_floating_point() and t.dtype != self.dtype and not keep_dtype else t


def load_state_dict(folder: Path, dtype: torch.dtype) -> LazyTensors:
    return LazyTensors(folder, dtype)


def dense_linear(w: "Weights", names: list[str], shapes: list[tuple[int, int]], conv1d: bool = False):
    """The default factory: fp projections that read the same input, fused into one Linear."""
    from qbench.layers.linear import Linear, fuse

    parts = []
    for name, (n, k) in zip(names, shapes):
        weight = w.get(name + ".weight", (k, n) if conv1d else (n, k))
        parts.append((weight.t() if conv1d else weight, w.maybe(name + ".bias", (n,))))
    return Linear(*parts[0]) if len(parts) == 1 else fuse(parts)


class Weights:
    """Named tensors with one clear error for a missing or misshapen one.

    ``linear`` builds the module for one or several projections that read the same input
    (q/k/v, gate/up). The factory is injected, so a quantized artifact can hand the same
    model code integer weights without the model importing the quantization package.
    """

    def __init__(self, tensors, where: str, prefixes: tuple[str, ...] = ("",), factory=None):
        self.tensors = tensors
        self.where = where
        self.factory = factory or dense_linear
        self.prefix = next((p for p in prefixes if any(k.startswith(p) for k in tensors.keys())), "")

    def has(self, name: str) -> bool:
        return (self.prefix + name) in self.tensors or name in self.tensors

    def get(self, name: str, shape: tuple[int, ...] | None = None, keep_dtype: bool = False,
            mapped: bool = False) -> torch.Tensor:
        # a stored fp16 / bf16 table stays narrow; a mapped one stays in the file until its pages are read
        kw = {**({"keep_dtype": True} if keep_dtype else {}), **({"mapped": True} if mapped else {})}
        t = self.tensors.get(self.prefix + name, **kw)
        if t is None:
            t = self.tensors.get(name, **kw)
        if t is None:
            raise QBenchError(f"{self.where}: tensor {self.prefix + name!r} is missing; the weights do not "
                              f"match config.json")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise QBenchError(f"{self.where}: tensor {name!r} has shape {tuple(t.shape)}, config.json implies "
                              f"{tuple(shape)}")
        return t

    def maybe(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor | None:
        return self.get(name, shape) if self.has(name) else None

    def has_linear(self, name: str) -> bool:
        """Any tensor of projection ``name`` (fp ``.weight`` or a quantized layout)."""
        heads = (self.prefix + name + ".", name + ".")
        return any(k.startswith(heads) for k in self.tensors.keys())

    def is_quantized(self, name: str) -> bool:
        return getattr(self.factory, "is_quantized", lambda w, n: False)(self, name)

    def embedding(self, name: str, shape: tuple[int, int], out_dtype: torch.dtype):
        """The token embedding table ``name`` (V, H) as a lookup module (the factory's, for an artifact that
        stores it narrower)."""
        make = getattr(self.factory, "embedding", None)
        if make is not None:
            return make(self, name, shape, out_dtype)
        from qbench.layers.embedding import Embedding
        return Embedding(self.get(name + ".weight", shape, mapped=True), out_dtype)

    def linear(self, names: list[str], shapes: list[tuple[int, int]], conv1d: bool = False):
        """Projections ``names`` with (out, in) ``shapes``, fused in order -> one module."""
        return self.factory(self, names, shapes, conv1d)

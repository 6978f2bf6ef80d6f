"""Compile the kernels once per source/flags/CPU into QBENCH_HOME and load them.

The build writes to a temporary file and renames it, so a concurrent or interrupted
build never leaves a broken library behind.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from functools import lru_cache
from pathlib import Path

from qbench.errors import QBenchError
from qbench.paths import qbench_home

SOURCES = ("gemm_f32.c", "ops_f32.c", "gemm_q.c", "gemm_a8.c", "gemm_a8_vnni.c", "gemm_a8_amx.c", "dequant.c", "attn_kv.c", "attn_prefill.c", "layer.c", "kv_store.c", "gptq.c")
HEADERS = ("panel.h", "a8_quad.h", "vecmath.h", "attn_kv256.h", "attn_kv512.h", "attn_kv_head.h", "attn_kv_rows.h")  # part of the cache key
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-shared", "-std=c11", "-lm"]


@lru_cache(maxsize=1)
def cpu_info() -> tuple[str, frozenset[str]]:
    """(model name, feature flags) from /proc/cpuinfo; (platform's processor, no flags) where it is absent."""
    import platform

    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():  # one block per core; the first one serves
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return (fields.get("model name") or platform.processor() or platform.machine(),
            frozenset(fields.get("flags", "").split()))


def cpu_supports() -> bool:
    return {"avx2", "fma", "f16c"} <= cpu_info()[1]


def machine() -> dict:
    """What a measurement ran on: speed figures only carry over between machines with the same CPU features."""
    import torch

    name, flags = cpu_info()
    shown = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_vbmi", "avx_vnni", "avx512_bf16", "amx_int8")
    return {"cpu": name, "cpu_flags": [f for f in shown if f in flags], "threads": torch.get_num_threads(),
            "torch": torch.__version__, "kernels": kernel_path(), "aten": torch.backends.cpu.get_cpu_capability()}


def kernel_path() -> str:
    """The native kernels' dispatch as it stands: "avx512+amx" (int8-activation GEMMs on AMX tiles), "avx512",
    "avx2", or "torch" where they are off or not built."""
    dll = load()
    if dll is None:
        return "torch"
    return "avx512+amx" if dll.qb_a8_amx() else "avx512" if dll.qb_isa() == 512 else "avx2"


def disabled() -> bool:
    return os.environ.get("QBENCH_NO_KERNELS", "") not in ("", "0")


ISAS = {"avx2": 256, "avx512": 512, "amx": 1024}


def forced_isa() -> int | None:
    """``QBENCH_ISA=avx2`` makes the kernels take their AVX2 path on an AVX-512 CPU (the run-time dispatch
    overridden, as the tests do with qb_set_isa); ``avx512`` the AVX-512 path without AMX's tiles (qb_set_amx);
    ``amx`` asks for AMX, which only a CPU with AMX-INT8 (and a kernel that grants it) can give."""
    name = os.environ.get("QBENCH_ISA", "")
    if name in ("", "auto"):
        return None
    if name not in ISAS:
        raise QBenchError(f"QBENCH_ISA={name}: unknown; use one of auto, {', '.join(ISAS)}")
    return ISAS[name]


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    """The compiled library, or None when kernels are disabled or cannot be built here."""
    if disabled() or not cpu_supports():
        return None
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        return None
    here = Path(__file__).parent
    src = b"".join((here / s).read_bytes() for s in (*SOURCES, *HEADERS))
    key = hashlib.sha256(src + " ".join(FLAGS).encode()).hexdigest()[:16]
    lib = qbench_home() / "kernels" / f"qbench_kernels_{key}.so"
    if not lib.is_file():
        lib.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
        os.close(fd)
        proc = subprocess.run([cc, *FLAGS, *(str(here / s) for s in SOURCES), "-o", tmp],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            Path(tmp).unlink(missing_ok=True)
            warnings.warn(f"qbench: could not compile the CPU kernels, using torch's path instead: "
                          f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")
            return None
        os.replace(tmp, lib)
    dll = ctypes.CDLL(str(lib))
    P, L, I, F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
    signatures = {
        "qb_gemm_f32_packed": [P, P, P, P, L, L, L, I],
        "qb_gemm_f32_panels": [P, P, P, P, L, L, L, L, I],
        "qb_log_softmax": [P, P, L, L, I],
        # q, kpool, vpool, tables, qpos, qvalid, out; B, T, nh, nkv, hd, bs, nblk; scale; threads
        "qb_prefill_attention": [P] * 7 + [L] * 7 + [F, I],
        "qb_rmsnorm": [P, P, P, L, L, F, I],
        "qb_silu_mul": [P, P, L, L, I],
        "qb_fwht": [P, L, L, L, I],
        "qb_rope": [P, P, P, P, L, L, L, L, I],
        "qb_paged_attention": [P] * 7 + [L] * 8 + [F, I],
        # q, out; B, T, nh, nkv, hd, bs, nblk; tables, qpos, qvalid, ctx, slots; W; rk, rv; window; scale;
        # K: mode, bits, codes, scale, min; V: mode, bits, group, codes, scale, min; threads
        "qb_attention_kv": [P, P] + [L] * 7 + [P] * 5 + [L, P, P, L, F, I, I, P, P, P, I, I, L, P, P, P, I],
        "qb_gemm_i8": [P] * 4 + [L] * 3 + [I],
        "qb_gemm_i4": [P] * 5 + [L] * 4 + [I],
        "qb_gemm_i4a8": [P] * 5 + [L] * 4 + [I],
        "qb_gemm_i8a8": [P] * 4 + [L] * 3 + [I],
        "qb_gemm_f8": [P] * 4 + [L] * 3 + [I],
        "qb_dequant_i8": [P] * 3 + [L] * 2 + [I, I],
        "qb_dequant_f8": [P] * 3 + [L] * 2 + [I, I],
        "qb_dequant_i4": [P] * 4 + [L] * 3 + [I, I],
        "qb_set_isa": [I],
        "qb_set_amx": [I],
        # W1, Hinv1; N, B, c0, c1; gidx, scales, zeros; ngroups; bits; codes, err; threads
        "qb_gptq_block": [P, P, L, L, L, L, P, P, P, L, I, P, P, I],
        # layers (qb_layer *), n, step (qb_step *), x, scratch, stages, threads
        "qb_decode_layers": [P, L, P, P, P, I, I],
        # x, src; n, bs, nkv, hd; mode, bits; vg; blocks, codes, scale, min; threads
        "qb_kv_store": [P, P, L, L, L, L, I, I, L, P, P, P, P, I],
    }
    for name, args in signatures.items():
        fn = getattr(dll, name)
        fn.restype, fn.argtypes = None, args
    dll.qb_isa.restype, dll.qb_isa.argtypes = ctypes.c_int, []
    dll.qb_a8_wide.restype, dll.qb_a8_wide.argtypes = ctypes.c_int, []
    dll.qb_a8_amx.restype, dll.qb_a8_amx.argtypes = ctypes.c_int, []
    dll.qb_a8_route.restype, dll.qb_a8_route.argtypes = ctypes.c_int, [L, L]
    dll.qb_decode_scratch.restype, dll.qb_decode_scratch.argtypes = ctypes.c_long, [P, L]
    isa = forced_isa()
    if isa is not None:
        if isa > dll.qb_isa() and not (isa == 1024 and dll.qb_a8_amx()):
            raise QBenchError(f"QBENCH_ISA={os.environ['QBENCH_ISA']}: this CPU ({cpu_info()[0]}) has no "
                              f"{'AMX-INT8' if isa == 1024 else 'AVX-512 VNNI'} path; unset QBENCH_ISA or use "
                              f"{'avx512 or ' if dll.qb_isa() == 512 else ''}avx2")
        dll.qb_set_isa(min(isa, 512))
        dll.qb_set_amx(int(isa == 1024))
    return dll


def available() -> bool:
    return load() is not None

"""`qbench sensitivity MODEL --schemes w4g128,w4g64,w8 --out FILE`: the model-level KL divergence that quantizing
one unit (a block, or one linear) alone causes, per scheme, on calibration text.

Each unit is fake-quantized in place (its weights replaced by their round-to-nearest dequantization, which is
what every qbench kernel computes with, up to summation order), the blocks from that unit on are replayed from
the fp model's stored hidden states, and the full-vocabulary KLD against the fp log-probs is measured on the
scored tokens. Nothing before the unit's block is recomputed, so a unit in block l costs (L - l) blocks and the
head, and every window runs in one batch.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch

from qbench.errors import QBenchError
from qbench.quant.primitives import GROUP_SIZES, dequantize, storage_bytes
from qbench.quant.apply import rtn

UNITS = ("block", "linear")
_SCHEME = re.compile(r"^w(?P<bits>4|8)(?:g(?P<group>\d+))?(?P<asym>-asym)?$")


@dataclass(frozen=True)
class Scheme:
    """A weight scheme by its short name: ``w8`` (INT8 per channel), ``w4g128`` / ``w4g64-asym`` (INT4 groups),
    or ``fp`` (kept in full precision)."""
    name: str
    bits: int | None  # None: fp
    group_size: int | None = None
    symmetric: bool = True

    @property
    def fp(self) -> bool:
        return self.bits is None

    def as_tuple(self) -> tuple:
        return self.bits, self.group_size, self.symmetric


def parse_scheme(name: str, where: str = "--schemes") -> Scheme:
    name = name.strip()
    if name == "fp":
        return Scheme("fp", None)
    m = _SCHEME.match(name)
    if m is None:
        raise QBenchError(f"{where}: {name!r} is not a scheme name; use w8, w4g32, w4g64, w4g128 (add -asym for "
                          f"asymmetric INT4) or fp")
    bits, group, asym = int(m["bits"]), m["group"], bool(m["asym"])
    if bits == 8 and (group or asym):
        raise QBenchError(f"{where}: {name!r}: INT8 is symmetric per output channel; write w8")
    if bits == 4 and (group is None or int(group) not in GROUP_SIZES):
        raise QBenchError(f"{where}: {name!r}: INT4 needs a group size of {', '.join(map(str, GROUP_SIZES))}, "
                          f"e.g. w4g128")
    return Scheme(name, bits, None if bits == 8 else int(group), not asym)


def parse_schemes(text: str, where: str = "--schemes") -> list[Scheme]:
    out = [parse_scheme(s, where) for s in text.split(",") if s.strip()]
    if not out:
        raise QBenchError(f"{where}: no scheme given; e.g. w4g128,w4g64,w8")
    if len({s.name for s in out}) != len(out):
        raise QBenchError(f"{where}: {text!r} names a scheme twice")
    return out


@dataclass(frozen=True)
class Unit:
    """What is quantized together: a block's linears (``blocks.3``) or one linear (``blocks.3.down_proj``)."""
    name: str
    block: int  # the first block whose output changes
    linears: tuple[str, ...]

    @property
    def pattern(self) -> str:
        """The recipe override glob that selects exactly this unit's linears."""
        return self.name if self.linears == (self.name,) else self.name + ".*"


def units(model, unit: str) -> list[Unit]:
    if unit not in UNITS:
        raise QBenchError(f"--unit {unit!r}: choose one of {', '.join(UNITS)}")
    linears = [p for p, _ in model.linear_map() if p != "lm_head"]
    out = []
    for i in range(model.config.num_layers):
        mine = tuple(p for p in linears if p.startswith(f"blocks.{i}."))
        if unit == "block":
            out.append(Unit(f"blocks.{i}", i, mine))
        else:
            out += [Unit(p, i, (p,)) for p in mine]
    return out


def linear_bytes(W: torch.Tensor, scheme: Scheme) -> int:
    """Exact stored bytes of one weight (out, in) under ``scheme`` (fp: float32)."""
    return W.numel() * 4 if scheme.fp else storage_bytes(rtn(W, *scheme.as_tuple()))


def fixed_bytes(model, names: list[str]) -> int:
    """Weight bytes outside the named linears' weight matrices (embedding, head, norms, biases)."""
    from qbench.models.base import unique_storage_bytes
    skip = set()
    for n in names:
        mod = model.get_submodule(n)
        for attr in ("packed", "weight_t"):
            t = getattr(mod, attr, None)
            if isinstance(t, torch.Tensor):
                skip.add(t.untyped_storage().data_ptr())
    rest = [t for t in [*model.parameters(), *model.buffers()] if t.untyped_storage().data_ptr() not in skip]
    return unique_storage_bytes(rest)


def mean_se(x: torch.Tensor) -> dict:
    """evals.stats.mean_se of a tensor, as the {mean, se} record the reports keep."""
    from qbench.evals.stats import mean_se as stats_mean_se
    m, se = stats_mean_se(x.double().numpy())
    return {"mean": m, "se": se}


def measure(model, ref, unit_list: list[Unit], schemes: list[Scheme], log=print) -> list[dict]:
    """Per unit: its bytes under every scheme and, per quantized scheme, the KLD and the change of -log p
    (mean and SE over the scored tokens) when it alone is quantized."""
    rows, t0 = [], time.perf_counter()
    measured = [s for s in schemes if not s.fp]
    for n, u in enumerate(unit_list, 1):
        mods = {p: model.get_submodule(p) for p in u.linears}
        weights = {p: m.weight.detach().clone() for p, m in mods.items()}  # (out, in) each
        row = {"unit": u.name, "block": u.block, "linears": list(u.linears),
               "params": sum(W.numel() for W in weights.values()),
               "bytes": {s.name: sum(linear_bytes(W, s) for W in weights.values()) for s in schemes},
               "kld": {}, "dnll": {}}
        try:
            for s in measured:
                for p, m in mods.items():
                    m.set_weight(dequantize(rtn(weights[p], *s.as_tuple())))
                out = ref.replay(u.block)
                row["kld"][s.name] = mean_se(out["kld"])
                row["dnll"][s.name] = mean_se(out["nll"] - ref.nll_fp())
        finally:
            for p, m in mods.items():
                m.set_weight(weights[p])
        for s in schemes:
            if s.fp:
                row["kld"][s.name], row["dnll"][s.name] = {"mean": 0.0, "se": 0.0}, {"mean": 0.0, "se": 0.0}
        rows.append(row)
        el = time.perf_counter() - t0
        log(f"  {u.name}: " + ", ".join(f"{s.name} KLD {row['kld'][s.name]['mean']:.5f}" for s in measured)
            + f"  [{n}/{len(unit_list)}, {el:.0f}s elapsed, about {el / n * (len(unit_list) - n):.0f}s left]")
    return rows

"""Quantization recipes: small dataclasses, validated on construction, loaded from YAML.

Every error names the file and the field, e.g. ``recipes/x.yaml: weights.group_size: 96 is not
supported (supported: 32, 64, 128)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from qbench.errors import QBenchError
from qbench.inputs import check_fields
from qbench.layers.kvscheme import KVScheme
from qbench.quant.primitives import ACTIVATIONS, GROUP_SIZES, TYPES, scheme_fits
from qbench.yamlfile import read_mapping

METHODS = ("rtn", "awq", "gptq")


class RecipeError(QBenchError):
    pass


def _check_keys(where: str, section: str, data: dict, cls) -> None:
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: {section} must be a mapping, got {type(data).__name__}")
    allowed = {f.name for f in fields(cls)}
    for key in data:
        if key not in allowed:
            raise RecipeError(f"{where}: unknown key {section + '.' if section else ''}{key} "
                              f"(allowed: {', '.join(sorted(allowed))})")


EMBEDDING_SCHEMES = ("fp32", "fp16", "bf16", "int8")  # int8: symmetric per row, dequantized on lookup


def _check_int_scheme(where: str, section: str, bits, group_size, symmetric) -> None:
    """bits / group_size / symmetric of an integer weight scheme, with the field named on error."""
    if type(bits) is not int or bits not in (4, 8):
        raise RecipeError(f"{where}: {section}.bits: {bits!r} is not supported (supported: 4, 8)")
    if not isinstance(symmetric, bool):
        raise RecipeError(f"{where}: {section}.symmetric: {symmetric!r} must be true or false")
    if bits == 4 and (type(group_size) is not int or group_size not in GROUP_SIZES):
        raise RecipeError(f"{where}: {section}.group_size: {group_size!r} is not supported "
                          f"(supported: {', '.join(map(str, GROUP_SIZES))})")
    if bits == 8 and (group_size is not None or not symmetric):
        raise RecipeError(f"{where}: {section}: INT8 is symmetric per output channel; drop group_size and "
                          f"symmetric")


@dataclass(frozen=True)
class HeadScheme:
    """The output head's own integer scheme, when it differs from the decoder linears'."""
    bits: int = 8
    group_size: int | None = None
    symmetric: bool = True

    def validate(self, where: str) -> None:
        _check_int_scheme(where, "weights.lm_head", self.bits, self.group_size, self.symmetric)


@dataclass(frozen=True)
class Override:
    """Another scheme for the decoder linears whose qbench name matches ``match`` (a glob over names such as
    ``blocks.3.qkv``, ``blocks.*.down_proj`` or ``blocks.0.*`` for a whole block). Fields left out keep the
    base scheme's; ``fp: true`` keeps the matched linears in full precision. The output head has its own
    field (``lm_head``) and is never matched."""
    match: str = ""
    bits: int | None = None
    group_size: int | None = None
    symmetric: bool | None = None
    fp: bool = False

    def validate(self, where: str, section: str) -> None:
        if not isinstance(self.match, str) or not self.match:
            raise RecipeError(f"{where}: {section}.match: {self.match!r} must be a non-empty name pattern, e.g. "
                              f"blocks.*.down_proj")
        if not isinstance(self.fp, bool):
            raise RecipeError(f"{where}: {section}.fp: {self.fp!r} must be true or false")
        if self.fp and (self.bits, self.group_size, self.symmetric) != (None, None, None):
            raise RecipeError(f"{where}: {section}: fp: true keeps the linears in full precision; drop bits, "
                              f"group_size and symmetric")

    def resolve(self, base: tuple) -> tuple:
        """(bits, group_size, symmetric) of the base scheme -> this override's (``WeightScheme.check_overrides``
        validates it at load)."""
        bits = base[0] if self.bits is None else self.bits
        group = self.group_size if self.group_size is not None else (None if bits == 8 else
                                                                       base[1] if base[0] == 4 else None)
        sym = self.symmetric if self.symmetric is not None else (True if bits == 8 else base[2])
        return bits, group, sym


@dataclass(frozen=True)
class WeightScheme:
    bits: int = 4
    group_size: int | None = 128
    symmetric: bool = True
    method: str = "rtn"
    lm_head: bool | HeadScheme = False  # true: the linears' scheme; a mapping: its own (INT8, or INT4 g)
    embedding: str = "fp32"  # how the token embedding table is stored: one of EMBEDDING_SCHEMES
    skip: tuple[str, ...] = ()  # module-name substrings kept in full precision
    activations: str = "fp32"  # int8: per-token int8 inputs for every quantized linear, the head too (W4A8, W8A8)
    type: str = "int"  # float: FP8 e4m3 codes per output channel (bits: 8), fp32 activations (W8A16)
    overrides: tuple[Override, ...] = ()  # per-linear schemes by name pattern over this base; the last match wins

    def validate(self, where: str) -> None:
        _check_int_scheme(where, "weights", self.bits, self.group_size, self.symmetric)
        if self.activations not in ACTIVATIONS:
            raise RecipeError(f"{where}: weights.activations: {self.activations!r} is not supported (supported: "
                              f"{', '.join(ACTIVATIONS)})")
        if self.method not in METHODS:
            raise RecipeError(f"{where}: weights.method: {self.method!r} is not one of {', '.join(METHODS)}")
        if self.type not in TYPES:
            raise RecipeError(f"{where}: weights.type: {self.type!r} is not supported (supported: {', '.join(TYPES)})")
        if self.type == "float" and (self.method != "rtn" or not scheme_fits(self.bits, self.activations, "float")):
            raise RecipeError(f"{where}: weights.type: float is FP8 e4m3 per output channel: it needs bits: 8, "
                              f"method: rtn and activations: fp32")
        if isinstance(self.lm_head, HeadScheme):
            self.lm_head.validate(where)
        elif not isinstance(self.lm_head, bool):
            raise RecipeError(f"{where}: weights.lm_head: {self.lm_head!r} must be true, false or a mapping "
                              f"{{bits, group_size, symmetric}}")
        if self.embedding not in EMBEDDING_SCHEMES:
            raise RecipeError(f"{where}: weights.embedding: {self.embedding!r} is not supported (supported: "
                              f"{', '.join(EMBEDDING_SCHEMES)})")
        self.check_overrides(where)

    def check_overrides(self, where: str) -> None:
        for i, o in enumerate(self.overrides):
            section = f"weights.overrides[{i}]"
            o.validate(where, section)
            if o.fp:
                continue
            if self.type != "int":
                raise RecipeError(f"{where}: {section}: the base scheme is FP8; overrides take integer schemes "
                                  f"(or fp: true) over an integer base")
            bits, group, sym = o.resolve((self.bits, self.group_size, self.symmetric))
            _check_int_scheme(where, section, bits, group, sym)
            if not scheme_fits(bits, self.activations, self.type):
                raise RecipeError(f"{where}: {section}.bits: {bits} does not run with activations: "
                                  f"{self.activations}")

    def linear_scheme(self, path: str) -> tuple[int, int | None, bool, str] | None:
        """(bits, group_size, symmetric, type) of the decoder linear ``path`` after the overrides, or None when
        it stays in full precision (an ``fp`` override)."""
        from fnmatch import fnmatchcase
        base = (self.bits, self.group_size, self.symmetric)
        scheme = (*base, self.type)
        for o in self.overrides:  # each against the base scheme (validated so at load), the last match winning
            if fnmatchcase(path, o.match):
                scheme = None if o.fp else (*o.resolve(base), self.type)
        return scheme

    def head_scheme(self) -> tuple[int, int | None, bool, str] | None:
        """(bits, group_size, symmetric, type) of the output head, or None when it stays in full precision."""
        if isinstance(self.lm_head, HeadScheme):
            return self.lm_head.bits, self.lm_head.group_size, self.lm_head.symmetric, "int"
        return (self.bits, self.group_size, self.symmetric, self.type) if self.lm_head else None


@dataclass(frozen=True)
class Calibration:
    data: str = "evals/data/wikitext-2-raw/wiki.valid.raw"
    samples: int = 32
    seq_len: int = 512
    seed: int = 0

    def validate(self, where: str) -> None:
        if "wiki.test" in self.data:
            raise RecipeError(f"{where}: calibration.data: {self.data} is a test split; calibrate on "
                              f"WikiText-2 valid, never on what is evaluated")
        for name in ("samples", "seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise RecipeError(f"{where}: calibration.{name}: {v!r} must be a positive integer")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise RecipeError(f"{where}: calibration.seed: {self.seed!r} must be an integer >= 0")


@dataclass(frozen=True)
class GPTQOptions:
    damp: float = 0.01
    block_size: int = 128
    act_order: bool = False

    def validate(self, where: str) -> None:
        if not 0 < self.damp < 1:
            raise RecipeError(f"{where}: gptq.damp: {self.damp!r} must be in (0, 1)")
        if self.block_size < 1:
            raise RecipeError(f"{where}: gptq.block_size: {self.block_size!r} must be >= 1")


@dataclass(frozen=True)
class AWQOptions:
    grid: int = 20
    max_tokens: int = 4096  # calibration tokens kept per layer for the scale search
    clip: bool = False  # llm-awq's clipping search (auto_clip) after the scales: see awq.search_clip

    def validate(self, where: str) -> None:
        if self.grid < 1 or self.max_tokens < 1:
            raise RecipeError(f"{where}: awq.grid and awq.max_tokens must be >= 1")
        if not isinstance(self.clip, bool):
            raise RecipeError(f"{where}: awq.clip: {self.clip!r} must be true or false")


@dataclass(frozen=True)
class SmoothQuantOptions:
    """SmoothQuant's smoothing (Xiao et al., 2023) before the weights are quantized: per input channel,
    s = max|X|^alpha / max|W|^(1 - alpha) from the calibration windows, folded into the RMSNorm before q/k/v
    and gate/up, into up before down and into v before o (one scale per V row, shared by the query heads of
    its group). ``search``: per mapping, the alpha of 0 .. 1 (step 0.1) whose smoothed, quantized layer is
    closest to the fp one on 1,024 of the calibration tokens."""
    alpha: float = 0.5
    search: bool = False

    def validate(self, where: str) -> None:
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 <= self.alpha <= 1:
            raise RecipeError(f"{where}: smoothquant.alpha: {self.alpha!r} must be a number in [0, 1]")
        if not isinstance(self.search, bool):
            raise RecipeError(f"{where}: smoothquant.search: {self.search!r} must be true or false")


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str = ""
    weights: WeightScheme | None = None  # None: weights stay in full precision
    calibration: Calibration = field(default_factory=Calibration)
    gptq: GPTQOptions = field(default_factory=GPTQOptions)
    awq: AWQOptions = field(default_factory=AWQOptions)
    kv: KVScheme | None = None  # None: a full-precision KV cache
    smoothquant: SmoothQuantOptions | None = None  # None: no smoothing

    @property
    def needs_calibration(self) -> bool:
        return self.weights is not None and (self.weights.method != "rtn" or self.smoothquant is not None)

    def to_dict(self) -> dict:
        from dataclasses import asdict
        return asdict(self)


SECTIONS = {"weights": WeightScheme, "calibration": Calibration, "gptq": GPTQOptions, "awq": AWQOptions,
            "smoothquant": SmoothQuantOptions}


def recipe_from_dict(data: dict, where: str) -> Recipe:
    _check_keys(where, "", data, Recipe)
    if "name" not in data or not isinstance(data["name"], str):
        raise RecipeError(f"{where}: missing string field 'name'")
    kwargs = {"name": data["name"], "description": str(data.get("description", ""))}
    for section, cls in SECTIONS.items():
        if data.get(section) is None:
            continue
        _check_keys(where, section, data[section], cls)
        raw = dict(data[section])
        if "skip" in raw:
            if not isinstance(raw["skip"], list) or not all(isinstance(x, str) for x in raw["skip"]):
                raise RecipeError(f"{where}: {section}.skip: {raw['skip']!r} must be a list of module-name substrings")
            raw["skip"] = tuple(raw["skip"])
        if section == "weights" and "overrides" in raw:
            raw["overrides"] = _overrides(raw["overrides"], where)
        if section == "weights" and isinstance(raw.get("lm_head"), dict):
            _check_keys(where, "weights.lm_head", raw["lm_head"], HeadScheme)
            raw["lm_head"] = HeadScheme(**raw["lm_head"])
            check_fields(raw["lm_head"], where, "weights.lm_head", RecipeError)
        try:
            obj = cls(**raw)
        except TypeError as e:
            raise RecipeError(f"{where}: {section}: {e}") from None
        check_fields(obj, where, section, RecipeError)
        obj.validate(where)
        kwargs[section] = obj
    if data.get("kv") is not None:
        kwargs["kv"] = kv_from_dict(data["kv"], where)
    if "awq" in kwargs and kwargs["awq"].clip and getattr(kwargs.get("weights"), "method", None) != "awq":
        raise RecipeError(f"{where}: awq.clip: the clipping search runs after AWQ's scales; set weights.method: awq, "
                          f"or drop awq.clip")
    if "smoothquant" in kwargs:
        ws = kwargs.get("weights")
        if ws is None or ws.activations != "int8":
            raise RecipeError(f"{where}: smoothquant: smoothing serves int8 activations; set weights.activations: "
                              f"int8, or drop the smoothquant section")
        if ws.method == "awq":
            raise RecipeError(f"{where}: smoothquant: AWQ folds its own scales into the same norms; use method rtn "
                              f"or gptq with smoothquant")
    return Recipe(**kwargs)


def _overrides(raw, where: str) -> tuple[Override, ...]:
    if not isinstance(raw, list):
        raise RecipeError(f"{where}: weights.overrides: must be a list of mappings {{match, bits, group_size, "
                          f"symmetric, fp}}")
    out = []
    for i, item in enumerate(raw):
        _check_keys(where, f"weights.overrides[{i}]", item, Override)
        o = Override(**item)
        check_fields(o, where, f"weights.overrides[{i}]", RecipeError)
        out.append(o)
    return tuple(out)


def kv_from_dict(raw, where: str) -> KVScheme:
    _check_keys(where, "kv", raw, KVScheme)
    try:
        kv = KVScheme(**raw)
    except (TypeError, ValueError) as e:
        raise RecipeError(f"{where}: {e}") from None
    check_fields(kv, where, "kv", RecipeError)
    return kv


def load_kv_scheme(spec: str) -> KVScheme:
    """The ``kv`` section of a recipe (by name or file), for running a model with a quantized KV cache."""
    recipe = load_recipe(spec)
    if recipe.kv is None:
        raise RecipeError(f"{spec}: this recipe has no kv section; use kv8, kv4, k4v2, kv-fp8 or a file with one")
    return recipe.kv


def load_recipe(spec: str, recipes_dir: Path | None = None) -> Recipe:
    """A recipe by file path, or by name from the project's recipes/ folder."""
    path = Path(spec)
    if not path.is_file() and path.suffix not in (".yaml", ".yml"):  # a name, which may hold dots (kld0.1)
        path = (recipes_dir or Path(__file__).resolve().parents[2] / "recipes") / f"{spec}.yaml"
    if not path.is_file():
        raise RecipeError(f"{spec}: no such recipe; give a YAML file or a name from recipes/")
    return recipe_from_dict(read_mapping(path, "recipe", RecipeError), str(path))

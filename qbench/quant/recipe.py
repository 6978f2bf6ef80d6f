"""Quantization recipes: small dataclasses, validated on construction, loaded from YAML.

Every error names the file and the field, e.g. ``recipes/x.yaml: weights.group_size: 96 is not
supported (supported: 32, 64, 128)``. The ``weights`` section lives in weight_scheme.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from qbench.inputs import check_fields
from qbench.layers.kvscheme import KVScheme
from qbench.quant.weight_scheme import HeadScheme, RecipeError, WeightScheme, check_keys, overrides_from_list
from qbench.yamlfile import read_mapping

__all__ = ["RecipeError", "Recipe", "WeightScheme", "Calibration", "GPTQOptions", "AWQOptions",
           "SmoothQuantOptions", "recipe_from_dict", "kv_from_dict", "load_kv_scheme", "load_recipe"]


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
    check_keys(where, "", data, Recipe)
    if "name" not in data or not isinstance(data["name"], str):
        raise RecipeError(f"{where}: missing string field 'name'")
    kwargs = {"name": data["name"], "description": str(data.get("description", ""))}
    for section, cls in SECTIONS.items():
        if data.get(section) is None:
            continue
        check_keys(where, section, data[section], cls)
        raw = dict(data[section])
        if "skip" in raw:
            if not isinstance(raw["skip"], list) or not all(isinstance(x, str) for x in raw["skip"]):
                raise RecipeError(f"{where}: {section}.skip: {raw['skip']!r} must be a list of module-name substrings")
            raw["skip"] = tuple(raw["skip"])
        if section == "weights" and "overrides" in raw:
            raw["overrides"] = overrides_from_list(raw["overrides"], where)
        if section == "weights" and isinstance(raw.get("lm_head"), dict):
            check_keys(where, "weights.lm_head", raw["lm_head"], HeadScheme)
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


def kv_from_dict(raw, where: str) -> KVScheme:
    check_keys(where, "kv", raw, KVScheme)
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

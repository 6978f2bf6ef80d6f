"""The ``weights`` section of a recipe: the base scheme of the decoder linears, the head's and the embedding's,
and per-linear overrides. Validated on construction, every error naming the file and the field. It also holds
what every recipe section shares (RecipeError, check_keys), since recipe.py imports from here and not back.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from qbench.errors import QBenchError
from qbench.inputs import check_fields
from qbench.quant.primitives import ACTIVATIONS, GROUP_SIZES, TYPES, scheme_fits

METHODS = ("rtn", "awq", "gptq")


class RecipeError(QBenchError):
    pass


def check_keys(where: str, section: str, data: dict, cls) -> None:
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
    field (``lm_head``) and is never matched. ``activations`` sets the matched linears' inputs apart from the
    base's (``fp32`` keeps, for example, ``down_proj`` at W8A16 in a W8A8 recipe). ``hadamard`` rotates the
    matched linears' inputs online (quant/hadamard.py; ``down_proj`` in a W8A8 recipe)."""
    match: str = ""
    bits: int | None = None
    group_size: int | None = None
    symmetric: bool | None = None
    fp: bool = False
    activations: str | None = None
    hadamard: bool | None = None

    def validate(self, where: str, section: str) -> None:
        if not isinstance(self.match, str) or not self.match:
            raise RecipeError(f"{where}: {section}.match: {self.match!r} must be a non-empty name pattern, e.g. "
                              f"blocks.*.down_proj")
        if not isinstance(self.fp, bool):
            raise RecipeError(f"{where}: {section}.fp: {self.fp!r} must be true or false")
        if self.fp and (self.bits, self.group_size, self.symmetric, self.activations, self.hadamard) != (None,) * 5:
            raise RecipeError(f"{where}: {section}: fp: true keeps the linears in full precision; drop bits, "
                              f"group_size, symmetric, activations and hadamard")
        if self.activations is not None and self.activations not in ACTIVATIONS:
            raise RecipeError(f"{where}: {section}.activations: {self.activations!r} is not supported (supported: "
                              f"{', '.join(ACTIVATIONS)})")

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
    hadamard: bool = False  # true: every decoder linear's inputs rotated online (quant/hadamard.py); the head never

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
        if self.hadamard or any(o.hadamard for o in self.overrides):
            if self.type != "int" or self.method == "awq":
                raise RecipeError(f"{where}: weights.hadamard: the rotation takes integer weights by rtn or gptq "
                                  f"(AWQ folds its own scales into the same inputs; FP8 has no rotated kernel)")
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
            acts = o.activations or self.activations
            if not scheme_fits(bits, acts, self.type):
                raise RecipeError(f"{where}: {section}.bits: {bits} does not run with activations: {acts}")

    def _last_match(self, path: str) -> Override | None:
        """The override that decides the decoder linear ``path``: each resolves against the base scheme
        (validated so at load), so the last one that matches wins whole."""
        from fnmatch import fnmatchcase
        return next((o for o in reversed(self.overrides) if fnmatchcase(path, o.match)), None)

    def linear_scheme(self, path: str) -> tuple[int, int | None, bool, str] | None:
        """(bits, group_size, symmetric, type) of the decoder linear ``path`` after the overrides, or None when
        it stays in full precision (an ``fp`` override)."""
        base = (self.bits, self.group_size, self.symmetric)
        o = self._last_match(path)
        if o is None:
            return (*base, self.type)
        return None if o.fp else (*o.resolve(base), self.type)

    def linear_activations(self, path: str) -> str:
        """The activations (``fp32`` or ``int8``) that the decoder linear ``path`` meets after the overrides: the
        deciding override's when it sets them, else the base scheme's."""
        o = self._last_match(path)
        return (o.activations if o is not None else None) or self.activations

    def linear_hadamard(self, path: str) -> bool:
        """Whether the decoder linear ``path``'s inputs are rotated online: the deciding override's say when it
        has one, else the base scheme's."""
        o = self._last_match(path)
        return o.hadamard if o is not None and o.hadamard is not None else self.hadamard

    def head_scheme(self) -> tuple[int, int | None, bool, str] | None:
        """(bits, group_size, symmetric, type) of the output head, or None when it stays in full precision."""
        if isinstance(self.lm_head, HeadScheme):
            return self.lm_head.bits, self.lm_head.group_size, self.lm_head.symmetric, "int"
        return (self.bits, self.group_size, self.symmetric, self.type) if self.lm_head else None


def overrides_from_list(raw, where: str) -> tuple[Override, ...]:
    if not isinstance(raw, list):
        raise RecipeError(f"{where}: weights.overrides: must be a list of mappings {{match, bits, group_size, "
                          f"symmetric, activations, hadamard, fp}}")
    out = []
    for i, item in enumerate(raw):
        check_keys(where, f"weights.overrides[{i}]", item, Override)
        o = Override(**item)
        check_fields(o, where, f"weights.overrides[{i}]", RecipeError)
        out.append(o)
    return tuple(out)

"""Reading what users give qbench (recipes, suites, data, prompts, runs, manifests): one function per kind of
read, each turning every way a file can be wrong into one QBenchError line that names the file."""

from __future__ import annotations

import json
import types
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path

from qbench.errors import QBenchError


def read_text(path: Path, what: str, error=QBenchError) -> str:
    """A text file as UTF-8 (a BOM is dropped); a missing, unreadable or non-UTF-8 file is one error line."""
    try:
        raw = Path(path).read_bytes()
    except IsADirectoryError:
        raise error(f"{path}: is a folder; give the {what} file") from None
    except OSError as e:
        raise error(f"{path}: cannot read the {what} ({e.strerror})") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise error(f"{path}:{line}: the {what} is not UTF-8 (byte 0x{raw[e.start]:02x}); save it as UTF-8") \
            from None


def read_json_object(path: Path, what: str, error=QBenchError) -> dict:
    """A JSON file holding an object (a mapping), as qbench writes its manifests and run records."""
    text = read_text(path, what, error)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}:{e.lineno}: the {what} is not valid JSON ({e.msg})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: the {what} must be a JSON object, not a {type(data).__name__}; it was not written "
                    f"by qbench or was damaged")
    return data


def check_fields(obj, where: str, section: str, error=QBenchError) -> None:
    """Every field of the dataclass ``obj`` holds a value of its annotated type (YAML gives any type: 128.0,
    "lots", [4, 128]); the first that does not is one error naming the file and the field."""
    hints = typing.get_type_hints(type(obj))
    for f in fields(obj):
        value, kind = getattr(obj, f.name), hints[f.name]
        if not _matches(value, kind):
            raise error(f"{where}: {section + '.' if section else ''}{f.name}: {value!r} must be {_describe(kind)}")


def _matches(v, t) -> bool:
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(v, a) for a in typing.get_args(t))
    if t is type(None):
        return v is None
    if t is bool:
        return isinstance(v, bool)
    if t is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if t is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if t is str:
        return isinstance(v, str)
    if origin in (tuple, list):
        args = [a for a in typing.get_args(t) if a is not Ellipsis]
        return isinstance(v, (tuple, list)) and all(_matches(x, args[0]) for x in v) if args else True
    if origin is dict or t is dict:
        return isinstance(v, dict)
    if is_dataclass(t):
        return isinstance(v, t)
    return True  # anything else is the class's own validate()'s to check


def _describe(t) -> str:
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(t))
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "empty"}
    if t in names:
        return names[t]
    if origin in (tuple, list):
        args = [a for a in typing.get_args(t) if a is not Ellipsis]
        return f"a list of {_describe(args[0]).removeprefix('a ').removeprefix('an ')}s" if args else "a list"
    if is_dataclass(t):
        return "a mapping of " + ", ".join(f.name for f in fields(t))
    return getattr(t, "__name__", str(t))

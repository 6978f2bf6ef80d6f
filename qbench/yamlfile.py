"""Reading the YAML files users write (recipes, suites): one clear error for a missing or malformed file."""

from __future__ import annotations

from pathlib import Path

import yaml

from qbench.inputs import read_text


def read_mapping(path: Path, what: str, error) -> dict:
    """The YAML mapping in ``path``; ``error`` (an exception class) names the file and what went wrong."""
    text = read_text(path, what, error)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise error(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: a {what} is a YAML mapping")
    return data

"""Reading the YAML files users write (recipes, suites): one clear error for a missing or malformed file."""

from __future__ import annotations

from pathlib import Path

import yaml


def read_mapping(path: Path, what: str, error) -> dict:
    """The YAML mapping in ``path``; ``error`` (an exception class) names the file and what went wrong."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise error(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    except OSError as e:
        raise error(f"{path}: cannot read the {what} ({e.strerror})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: a {what} is a YAML mapping")
    return data

"""Where qbench keeps what it downloads and converts."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


def qbench_home() -> Path:
    return Path(os.environ.get("QBENCH_HOME", Path.home() / ".cache" / "qbench")).expanduser()


@contextmanager
def atomic_dir(final: Path):
    """Yield a temporary folder beside ``final``; rename it into place only on success.

    A failure or Ctrl-C removes the temporary folder, so ``final`` is either absent or whole.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

"""Where qbench keeps what it downloads and converts, and how it writes its outputs without ever
destroying a folder it did not write.

Every output folder (an artifact, an export, a report, a pulled model) is built in a temporary folder
beside its final place and renamed into place only when whole. It carries a marker, ``.qbench-output.json``,
with its kind and the size of every file qbench wrote into it. An existing folder is replaced only when
that marker says it is a whole output of the same kind; anything else is refused with one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path

from qbench.errors import QBenchError

MARKER = ".qbench-output.json"
KINDS = ("artifact", "export", "report", "model")


class OutputError(QBenchError):
    pass


def qbench_home() -> Path:
    return Path(os.environ.get("QBENCH_HOME", Path.home() / ".cache" / "qbench")).expanduser()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tensors_sha256(path: Path) -> str:
    """sha256 of a safetensors file's content: its header with keys sorted, then its data. The writer
    stores the metadata map in hash order, so two byte-different files of identical tensors and
    metadata (the same quantization run twice) get one digest here; other files hash as they are."""
    import struct
    if Path(path).suffix != ".safetensors":
        return sha256_file(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h.update(json.dumps(json.loads(f.read(n)), sort_keys=True).encode())
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def user_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _listing(root: Path) -> dict[str, int]:
    """Every file under ``root`` (links included, never followed) -> its size, the marker left out."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in files + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
            p = Path(d, name)
            rel = p.relative_to(root).as_posix()
            if rel != MARKER:
                out[rel] = p.lstat().st_size
    return out


def refuse_file_above(path: Path) -> None:
    """No folder can be made at ``path`` if one of its parents is a file: say so before any work."""
    for p in Path(path).parents:
        if p.exists() and not p.is_dir():
            raise OutputError(f"{path}: {p} is a file, so no folder can be made under it; choose another --out")


def _refuse_always(final: Path) -> None:
    """Folders no --force can make qbench replace."""
    if final.is_symlink():
        raise OutputError(f"{final}: is a symbolic link; give the path of a real folder for --out")
    if final.exists() and not final.is_dir():
        raise OutputError(f"{final}: exists and is a file, not a folder; give a folder path for --out")
    real, here = final.resolve(), Path.cwd().resolve()
    if real == here or real in here.parents or real == Path.home().resolve() or real == Path(real.anchor):
        raise OutputError(f"{final}: is the current folder, one of its parents or your home; qbench never "
                          f"replaces it; give a new folder for --out")
    if (real / ".git").exists():
        raise OutputError(f"{final}: holds a .git folder; qbench never replaces it; give a new folder for --out")


def check_output(final: Path, kind: str, force: bool = False) -> None:
    """Refuse ``final`` unless writing there destroys nothing: it is absent, empty, or a whole qbench output
    of the same ``kind`` (with ``force``: also one whose files were changed or removed since). Called before
    any long work, and again just before the rename."""
    assert kind in KINDS, kind
    final = Path(final)
    refuse_file_above(final)
    _refuse_always(final)
    if not final.exists() or not any(final.iterdir()):
        return
    marker = final / MARKER
    how = "choose another --out, or move that folder away yourself"
    if not marker.is_file():
        raise OutputError(f"{final}: exists and is not an output qbench wrote (no {MARKER}); {how}")
    try:
        rec = json.loads(marker.read_text(encoding="utf-8"))
        old_kind, files = rec["kind"], {str(k): int(v) for k, v in rec["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        raise OutputError(f"{final}: its {MARKER} is unreadable, so qbench cannot tell what it wrote there; {how}") \
            from None
    if old_kind != kind:
        raise OutputError(f"{final}: holds a qbench {old_kind}, not {_a(kind)}; {how}")
    present = _listing(final)
    extra = sorted(set(present) - set(files))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise OutputError(f"{final}: holds {extra[0]}{more}, which qbench did not write; {how}")
    changed = sorted(f for f in files if present.get(f) != files[f])
    if changed and not force:
        raise OutputError(f"{final}: a qbench {kind} whose {changed[0]} is missing or changed since qbench wrote "
                          f"it; pass --force to replace it, or choose another --out")


def _a(kind: str) -> str:
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


STAMP = "written_by"  # the key a single-file JSON output (a bench report) carries, with the command's name


def check_output_file(path: Path, writer: str) -> None:
    """Refuse to overwrite ``path`` unless it is a JSON report that ``writer`` (e.g. "qbench bench") wrote."""
    path = Path(path)
    refuse_file_above(path)
    if path.is_dir():
        raise OutputError(f"{path}: is a folder; give a file path for --out")
    if path.exists():
        try:
            ours = json.loads(path.read_text(encoding="utf-8")).get(STAMP) == writer
        except (OSError, ValueError, AttributeError):
            ours = False
        if not ours:
            raise OutputError(f"{path}: exists and is not a report {writer} wrote; choose another --out, or move "
                              f"that file away yourself")


def write_marker(folder: Path, kind: str) -> None:
    """Record ``folder`` as a whole qbench output of ``kind``: every file in it, with its size."""
    record = {"kind": kind, "files": dict(sorted(_listing(folder).items()))}
    (Path(folder) / MARKER).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(final: Path) -> None:
    """Remove what a killed write to ``final`` left beside it: ``.NAME.tmp-*`` folders whose writer is gone,
    and ``.NAME.old-*`` (a replaced output whose removal was cut short)."""
    parent = final.parent
    if not parent.is_dir():
        return
    for p in parent.glob(f".{final.name}.tmp-*"):
        try:  # .NAME.tmp-PID-RANDOM: the writer's pid
            pid = int(p.name[len(final.name) + 6:].split("-")[0])
        except ValueError:
            pid = None
        if p.is_dir() and not p.is_symlink() and (pid is None or not _alive(pid)):
            shutil.rmtree(p, ignore_errors=True)
    for p in parent.glob(f".{final.name}.old-*"):
        if p.is_dir() and not p.is_symlink() and (p / MARKER).is_file():
            shutil.rmtree(p, ignore_errors=True)


def _apply_umask(root: Path) -> None:
    """Give a finished output the modes the user's umask asks for (mkdtemp and mkstemp make 0700 / 0600)."""
    mask = user_umask()
    os.chmod(root, 0o777 & ~mask)
    for d, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(os.path.join(d, name), 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(d, name), 0o666 & ~mask)


def _mkdir(folder: Path, final: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{final}: cannot create {folder} ({e.strerror}); choose another --out") from None


@contextmanager
def atomic_dir(final: Path, kind: str, force: bool = False):
    """Yield a temporary folder beside ``final``; on success mark it as a ``kind`` output and rename it into
    place, replacing ``final`` only where ``check_output`` allows. A failure or Ctrl-C removes the temporary
    folder, so ``final`` is either as it was or whole."""
    final = Path(final)
    check_output(final, kind, force)
    _mkdir(final.parent, final)
    remove_stale_temps(final)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=final.parent))
    except OSError as e:
        raise OutputError(f"{final}: cannot write in {final.parent} ({e.strerror}); choose another --out") from None
    try:
        yield tmp
        write_marker(tmp, kind)
        _apply_umask(tmp)
        check_output(final, kind, force)  # again: the folder may have changed during the work
        if final.exists():
            old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
            try:
                os.replace(tmp, final)
            except BaseException:
                os.replace(old, final)
                raise
            shutil.rmtree(old)  # it held only what qbench wrote (checked above)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write a file whole or not at all, with the user's umask."""
    path = Path(path)
    _mkdir(path.parent, path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    except OSError as e:
        raise OutputError(f"{path}: cannot write in {path.parent} ({e.strerror}); choose another path") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~user_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

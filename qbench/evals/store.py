"""A run's folder: per-item records written as they complete, so an interrupted eval resumes.

    RUN/results.json          the summary (written last, atomically)
    RUN/items/TASK.jsonl      one JSON line per finished item; a torn last line is ignored
    RUN/parts/TASK/KEY.safetensors   per-chunk tensors (written atomically)
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from qbench.errors import QBenchError
from qbench.paths import user_umask


class RunStore:
    def __init__(self, root: Path, write: bool = True):
        self.root = Path(root)
        self.write = write  # False on every data-parallel rank but the first: they read, rank 0 writes

    def jsonl(self, task: str) -> Path:
        return self.root / "items" / f"{task}.jsonl"

    def load_items(self, task: str) -> dict[str, dict]:
        path = self.jsonl(task)
        out = {}
        if path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line torn by an interrupt: that item is simply redone
                out[rec["key"]] = rec
        return out

    def add_item(self, task: str, rec: dict) -> None:
        if self.write:
            append_line(self.jsonl(task), rec)

    def counts(self) -> dict[str, int]:
        """How many items and chunk parts each task has stored: what a resumed run will not compute again."""
        out: dict[str, int] = {}
        for f in sorted((self.root / "items").glob("*.jsonl")):
            out[f.stem] = out.get(f.stem, 0) + len(self.load_items(f.stem))
        for d in sorted(p for p in (self.root / "parts").glob("*") if p.is_dir()):
            name = "chunks" if d.name.startswith("chunks-") else d.name  # the KLD/perplexity windows, shared
            out[name] = out.get(name, 0) + sum(1 for f in d.glob("*.safetensors") if not f.name.startswith("."))
        return out

    def part(self, task: str, key: str) -> Path:
        return self.root / "parts" / task / f"{key}.safetensors"

    def load_part(self, task: str, key: str) -> dict[str, torch.Tensor] | None:
        p = self.part(task, key)
        if not p.is_file():
            return None
        try:
            return load_file(str(p))
        except Exception as e:  # safetensors raises its own error type for a damaged file
            raise QBenchError(f"{p}: damaged ({str(e).splitlines()[0][:100]}); delete it and run the same "
                              f"`qbench eval` again to recompute it") from None

    def save_part(self, task: str, key: str, tensors: dict[str, torch.Tensor], meta: dict | None = None) -> None:
        if not self.write:
            return
        p = self.part(task, key)
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.tmp-", dir=p.parent)
        os.close(fd)
        try:
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=meta)
            os.chmod(tmp, 0o666 & ~user_umask())  # mkstemp made it 0600
            os.replace(tmp, p)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def append_line(path: Path, rec: dict) -> None:
    """Append one JSON line durably; a line torn by an earlier interrupt is left alone on its own line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        # an interrupt can leave a torn last line: start on a fresh line, or this record would join it
        # and be lost with it on the next resume
        torn = False
        if f.seek(0, os.SEEK_END) > 0:
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
        f.write((("\n" if torn else "") + json.dumps(rec, sort_keys=True) + "\n").encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())

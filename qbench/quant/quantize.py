"""`qbench quantize MODEL --recipe R --out DIR`: load, calibrate, quantize, write atomically."""

from __future__ import annotations

import dataclasses

import platform
from datetime import datetime, timezone
from pathlib import Path

import torch

from qbench import __version__
from qbench.errors import QBenchError
from qbench.layers.kvscheme import kv_memory
from qbench.models.weights import weight_files
from qbench.models.zoo import SOURCE_FILE, resolve_model
from qbench.paths import atomic_dir, check_output, tensors_sha256
from qbench.quant.apply import check_recipe, quantize_model
from qbench.quant.artifact import is_artifact, read_manifest, verify_files
from qbench.quant.artifact_write import save_artifact
from qbench.quant.calibration import calibration_windows
from qbench.quant.recipe import Recipe, load_recipe


def versions() -> dict:
    import transformers
    return {"qbench": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def _git(root: Path, *args: str):
    """One git command in the checkout at ``root``; None when git cannot run."""
    import subprocess
    try:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None


def _checkout() -> Path | None:
    root = Path(__file__).resolve().parents[2]
    return root if (root / ".git").exists() and (root / "pyproject.toml").is_file() else None


def source_commit() -> str | None:
    """The git commit qbench runs from ("+dirty" when tracked files differ from it); None outside a checkout.
    Eval results record it, so a report whose runs were made by different code says so."""
    root = _checkout()
    head = _git(root, "rev-parse", "HEAD") if root else None
    if head is None or head.returncode != 0:
        return None
    dirty = _git(root, "status", "--porcelain", "-uno")
    return head.stdout.strip() + ("+dirty" if dirty is not None and dirty.returncode == 0 and dirty.stdout.strip() else "")


# What cannot change an artifact's bytes: documentation, the committed demo report, the tests and CI. Everything
# else (qbench/, recipes/, evals/ with the calibration text, pyproject.toml, scripts) counts as the code.
NOT_CODE = (":(exclude)*.md", ":(exclude)artifacts", ":(exclude)tests", ":(exclude).ci")


def uncommitted_code(root: Path) -> bool:
    """Whether tracked files outside NOT_CODE differ from HEAD (True when git cannot tell)."""
    st = _git(root, "status", "--porcelain", "-uno", "--", ".", *NOT_CODE)
    return st is None or st.returncode != 0 or bool(st.stdout.strip())


def same_code(made_by: str | None, current: str | None, root: Path | None = None) -> bool:
    """Whether the commit that made an artifact (``made_by``, from its manifest) ran the code that runs now
    (``current``, from source_commit): the same commit, or commits whose trees differ only in NOT_CODE, with no
    uncommitted change outside NOT_CODE. A README commit in the middle of a resumed `make demo` then does not
    throw away an hour of AWQ calibration. A commit this checkout does not have (a shallow clone) is not the same."""
    root = root or _checkout()
    if not made_by or not current or made_by.endswith("+dirty") or root is None:
        return False
    head = current.removesuffix("+dirty")
    if current.endswith("+dirty") and uncommitted_code(root):
        return False
    if made_by == head:
        return True
    diff = _git(root, "diff", "--quiet", made_by, head, "--", ".", *NOT_CODE)
    return diff is not None and diff.returncode == 0  # 1: the code differs; 128: a commit unknown here


def calibration_path() -> dict:
    """What computed a calibration pass (qbench's kernels and their instruction set, ATen's vectorised ops, the
    CPU, threads, torch). The calibration runs in float64 so that these do not change the artifact (wide.py);
    the record says where an artifact came from if one ever does."""
    from qbench.kernels import build

    lib = build.load()
    return {"qbench_kernels": "off" if lib is None else ("avx512" if lib.qb_isa() == 512 else "avx2"),
            "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(), "mkldnn": torch.backends.mkldnn.is_available(),
            **build.machine()}  # cpu, cpu_flags, threads, torch: what bench records of a machine


def source_sha256(folder: Path) -> str:
    return ",".join(tensors_sha256(f) for f in weight_files(folder))


def reusable(out: Path, recipe: Recipe, folder: Path) -> dict | None:
    """The manifest of the artifact in ``out`` when this very command made it: a whole qbench artifact (no file
    changed since), from the same source weights, recipe (calibration windows included) and qbench code (same_code).
    Quantization is deterministic (the same artifact on every machine), so re-running would give its bytes again;
    a resumed `make demo` skips the work. Anything else: None, and the caller quantizes as usual."""
    import json
    if not is_artifact(Path(out)):
        return None
    try:
        check_output(Path(out), "artifact")  # raises if qbench did not write it, or a file changed since
        m = read_manifest(out)
        verify_files(out, m)  # the files' hashes, not only their sizes: what is kept is what was written
    except QBenchError:
        return None
    if not same_code(m.get("qbench_commit"), source_commit()):
        return None
    if m.get("recipe") != json.loads(json.dumps(recipe.to_dict())) or \
            m.get("source", {}).get("sha256") != source_sha256(folder):  # compared as the manifest stores them
        return None
    return m


def run_quantize(model_spec: str, recipe_spec: str, out: Path, log=print, calibration_samples: int | None = None,
                 force: bool = False, reuse: bool = False) -> dict:
    from qbench.engine.api import load_tokenizer
    from qbench.models.registry import load_model

    recipe: Recipe = load_recipe(recipe_spec)
    if calibration_samples is not None:  # fewer windows: faster, recorded in the manifest's recipe
        if calibration_samples < 1:
            raise QBenchError(f"--calibration-samples {calibration_samples}: must be a positive integer")
        if not recipe.needs_calibration:
            raise QBenchError(f"--calibration-samples: recipe {recipe.name} ({recipe.weights.method if recipe.weights else 'kv only'}) "
                              f"uses no calibration data; drop the option")
        recipe = dataclasses.replace(recipe, calibration=dataclasses.replace(recipe.calibration, samples=calibration_samples))
    folder = resolve_model(model_spec)
    if is_artifact(folder):
        raise QBenchError(f"{model_spec}: already a quantized artifact; quantize the fp source model instead")
    out = Path(out)
    if reuse:
        same = reusable(out, recipe, folder)
        if same is not None:
            log(f"reusing {out}: made by the same qbench code (commit {same['qbench_commit'][:12]}) from the same "
                f"source and recipe (weights {same.get('weights_sha256', '?')[:12]})")
            return same
    check_output(out, "artifact", force)  # before the long work, and again before the rename
    model = load_model(folder, torch.float32)
    if recipe.kv is not None:
        try:
            recipe.kv.check(recipe.kv.group, model.config.head_dim)
        except ValueError as e:
            raise QBenchError(f"{recipe_spec}: {e}") from None
    if recipe.weights is not None:
        check_recipe(model, recipe)
    torch.manual_seed(recipe.calibration.seed)
    calib, calib_record = None, None
    if recipe.needs_calibration:
        calib, calib_record = calibration_windows(load_tokenizer(folder), recipe.calibration)
        log(f"calibration: {calib.shape[0]} windows of {calib.shape[1]} tokens from {recipe.calibration.data}")
    result = None
    if recipe.weights is not None:
        log(f"quantizing weights: {recipe.weights.method} {recipe.weights.bits}-bit"
            + (f" g{recipe.weights.group_size}" if recipe.weights.bits == 4 else ""))
        result = quantize_model(model, recipe, calib, log=log)
    scheme = None if recipe.weights is None else {
        "bits": recipe.weights.bits, "group_size": recipe.weights.group_size,
        "symmetric": recipe.weights.symmetric, "method": recipe.weights.method, "scale_dtype": "float16",
        "packing": "int4: two codes per byte along the input dimension, even index in the low nibble, "
                   "unsigned codes (symmetric offset by 8)" if recipe.weights.bits == 4 else
                   "fp8 e4m3fn codes" if recipe.weights.type == "float" else "int8 codes"}
    if scheme is not None and recipe.weights.type != "int":  # recorded only when set, as per tensor
        scheme["type"] = recipe.weights.type
    src_record = {"model": model_spec, "folder": str(folder), "sha256": source_sha256(folder)}
    if (folder / SOURCE_FILE).is_file():
        import json
        src_record["provenance"] = json.loads((folder / SOURCE_FILE).read_text())
    manifest = {
        "recipe": recipe.to_dict(), "source": src_record, "versions": versions(), "qbench_commit": source_commit(),
        "seed": recipe.calibration.seed,
        "calibration": calib_record, "calibration_path": calibration_path() if recipe.needs_calibration else None,
        "layers": [] if result is None else result.layers,
        "fp_linears": [] if result is None else [p for p, _ in model.linear_map() if p not in result.qtensors],
        "quantize_seconds": None if result is None else round(result.seconds, 2),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "kv": None if recipe.kv is None else dict(recipe.kv.to_dict(), memory=kv_memory(
            recipe.kv, model.config.num_layers, model.config.num_kv_heads, model.config.head_dim)),
    }
    with atomic_dir(out, "artifact", force) as tmp:
        manifest = save_artifact(model, folder, tmp, scheme, {} if result is None else result.qtensors, manifest,
                                 None if result is None else result.embedding)
    return manifest

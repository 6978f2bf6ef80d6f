"""qbench never destroys a folder it did not write (paths.atomic_dir / check_output), honours the umask, and
cleans what a killed write left. Unit tests of the rule; the commands' own cases are in test_bad_input.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from qbench.paths import MARKER, OutputError, atomic_dir, check_output, remove_stale_temps


def write_output(final, kind="report", files=None):
    with atomic_dir(final, kind) as tmp:
        for name, text in (files or {"a.txt": "one", "sub/b.txt": "two"}).items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_text(text)
    return final


def tree(root):
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def test_a_new_output_is_marked_with_its_kind_and_files(tmp_path):
    out = write_output(tmp_path / "r")
    rec = json.loads((out / MARKER).read_text())
    assert rec == {"kind": "report", "files": {"a.txt": 3, "sub/b.txt": 3}}
    assert [p.name for p in tmp_path.iterdir()] == ["r"]  # no temporary folder left


def test_a_whole_output_of_the_same_kind_is_replaced(tmp_path):
    out = write_output(tmp_path / "r")
    write_output(out, files={"c.txt": "three"})
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "c.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["r"]


@pytest.mark.parametrize("setup, message", [
    (lambda d: (d / "notes.txt").write_text("mine"), "is not an output qbench wrote"),
    (lambda d: (d / ".env").write_text("SECRET=1"), "is not an output qbench wrote"),
    (lambda d: (d / "summary.json").write_text("{}"), "is not an output qbench wrote"),
    (lambda d: (d / "qbench.json").write_text("{}"), "is not an output qbench wrote"),
    (lambda d: (d / ".git").mkdir(), "holds a .git folder"),
    (lambda d: (d / MARKER).write_text("not json"), "is unreadable"),
    (lambda d: (d / MARKER).write_text("[1, 2]"), "is unreadable"),
    (lambda d: (d / MARKER).write_text('{"kind": "artifact", "files": {}}'), "holds a qbench artifact, not a report"),
])
def test_a_folder_qbench_did_not_write_is_refused_even_with_force(tmp_path, setup, message):
    d = tmp_path / "mine"
    d.mkdir()
    setup(d)
    before = tree(d)
    for force in (False, True):
        with pytest.raises(OutputError, match=message):
            write_output(d)
        with pytest.raises(OutputError, match=message):
            check_output(d, "report", force)
        assert tree(d) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_a_user_file_added_to_an_output_is_never_deleted(tmp_path):
    out = write_output(tmp_path / "r")
    (out / "my-notes.md").write_text("mine")
    for force in (False, True):
        with pytest.raises(OutputError, match="holds my-notes.md, which qbench did not write"):
            check_output(out, "report", force)
    assert (out / "my-notes.md").read_text() == "mine"


def test_a_changed_output_is_replaced_only_with_force(tmp_path):
    out = write_output(tmp_path / "r")
    (out / "a.txt").write_text("edited by hand")
    with pytest.raises(OutputError, match="a.txt is missing or changed.*pass --force"):
        write_output(out)
    assert (out / "a.txt").read_text() == "edited by hand"
    with atomic_dir(out, "report", force=True) as tmp:
        (tmp / "new.txt").write_text("x")
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "new.txt"]


def test_the_current_folder_its_parents_and_home_are_never_replaced(tmp_path, monkeypatch):
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    (work / "x.txt").write_text("mine")
    monkeypatch.chdir(work)
    for target in (".", str(work), str(tmp_path / "a"), os.path.expanduser("~")):
        with pytest.raises(OutputError, match="current folder, one of its parents or your home"):
            check_output(target, "report", force=True)
    assert (work / "x.txt").read_text() == "mine"


def test_files_and_links_in_the_way_are_refused(tmp_path):
    f = tmp_path / "file"
    f.write_text("mine")
    with pytest.raises(OutputError, match="is a file, not a folder"):
        check_output(f, "report")
    with pytest.raises(OutputError, match="is a file, so no folder can be made under it"):
        check_output(f / "sub" / "out", "report")
    out = write_output(tmp_path / "r")
    (tmp_path / "link").symlink_to(out)
    with pytest.raises(OutputError, match="is a symbolic link"):
        check_output(tmp_path / "link", "report")
    assert f.read_text() == "mine"


def test_an_unwritable_parent_is_one_clear_error(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(OutputError, match="cannot write in"):
            write_output(ro / "r")
    finally:
        ro.chmod(0o755)


def test_an_empty_folder_is_used(tmp_path):
    (tmp_path / "r").mkdir()
    write_output(tmp_path / "r")
    assert (tmp_path / "r" / MARKER).is_file()


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_outputs_follow_the_umask(tmp_path, mask):
    old = os.umask(mask)
    try:
        out = write_output(tmp_path / "r")
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o777 & ~mask
    assert (out / "sub").stat().st_mode & 0o777 == 0o777 & ~mask
    for f in (out / "a.txt", out / "sub" / "b.txt", out / MARKER):
        assert f.stat().st_mode & 0o777 == 0o666 & ~mask


def test_a_failed_write_leaves_the_old_output_and_no_temporary(tmp_path):
    out = write_output(tmp_path / "r")
    before = tree(out)
    with pytest.raises(RuntimeError):
        with atomic_dir(out, "report") as tmp:
            (tmp / "half.txt").write_text("x")
            raise RuntimeError("boom")
    assert tree(out) == before and [p.name for p in tmp_path.iterdir()] == ["r"]


KILLED = """
import sys, time
from qbench.paths import atomic_dir
with atomic_dir(sys.argv[1], "report") as tmp:
    (tmp / "half.txt").write_text("x")
    print("inside", flush=True)
    time.sleep(60)
"""


def test_temporaries_of_a_killed_write_are_removed_by_the_next_write(tmp_path):
    out = tmp_path / "r"
    p = subprocess.Popen([sys.executable, "-c", KILLED, str(out)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "inside"
    temps = [x for x in tmp_path.iterdir() if x.name.startswith(".r.tmp-")]
    assert len(temps) == 1
    remove_stale_temps(out)  # its writer is alive: kept
    assert temps[0].exists()
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert temps[0].exists() and not out.exists()  # SIGKILL runs no cleanup
    (tmp_path / ".r.tmp-user").write_text("a file of the user's that happens to match: kept")
    write_output(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".r.tmp-user", "r"]


def test_a_concurrent_change_during_the_work_is_caught_before_the_rename(tmp_path):
    out = write_output(tmp_path / "r")
    with pytest.raises(OutputError, match="holds late.txt"):
        with atomic_dir(out, "report") as tmp:
            (tmp / "x").write_text("x")
            (out / "late.txt").write_text("written meanwhile")
            time.sleep(0)
    assert (out / "late.txt").read_text() == "written meanwhile"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]


def test_an_item_redone_after_a_torn_line_is_kept_on_a_line_of_its_own(tmp_path):
    from qbench.evals.store import RunStore
    store = RunStore(tmp_path)
    store.add_item("t", {"key": "a", "v": 1})
    with open(store.jsonl("t"), "a") as f:
        f.write('{"key": "b", "v"')  # torn by a kill in the middle of a write
    assert set(store.load_items("t")) == {"a"}  # b is redone ...
    store.add_item("t", {"key": "b", "v": 2})
    store.add_item("t", {"key": "c", "v": 3})
    assert store.load_items("t") == {"a": {"key": "a", "v": 1}, "b": {"key": "b", "v": 2},
                                     "c": {"key": "c", "v": 3}}  # ... and not lost on the next resume
    assert store.jsonl("t").read_text().endswith('"v": 3}\n')

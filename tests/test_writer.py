"""The one writer (launcher/writer.py): no link followed, never a file it did not write replaced,
a temporary name renamed into place, the partial file removed on any error (a full disk too); and
the rule that every file the launcher writes is written there, enforced on the code."""

import ast
import errno
import os
from pathlib import Path

import pytest

from launcher import writer
from launcher.errors import LauncherError

REPO = Path(__file__).resolve().parent.parent
links = pytest.mark.skipif(os.name == "nt", reason="creating links needs rights Windows does not grant by default")


def test_a_new_file_appears_whole_and_nothing_else_is_left(tmp_path):
    path = writer.write_new(tmp_path / "out" / "report.json", '{"a": 1}\n')
    assert path.read_text(encoding="utf-8") == '{"a": 1}\n'
    assert sorted(p.name for p in path.parent.iterdir()) == ["report.json"]


def test_a_new_file_never_replaces_one_that_stands_there(tmp_path):
    mine = tmp_path / "photo.png"
    mine.write_bytes(b"a user's photo")
    with pytest.raises(LauncherError, match="exists; it is never overwritten"):
        writer.write_new(mine, b"plot")
    assert mine.read_bytes() == b"a user's photo"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["photo.png"]


def test_an_own_file_is_replaced_whole(tmp_path):
    state = writer.replace_own(tmp_path / "state.json", "old")
    writer.replace_own(state, "new")
    assert state.read_text(encoding="utf-8") == "new" and len(list(tmp_path.iterdir())) == 1


@pytest.mark.parametrize("replace", [False, True], ids=["new", "own"])
def test_a_full_disk_leaves_no_partial_file_and_names_the_file(tmp_path, monkeypatch, replace):
    target = tmp_path / "run.json"
    if replace:
        target.write_text("the old state", encoding="utf-8")

    def full(descriptor):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer.os, "fsync", full)
    with pytest.raises(LauncherError) as refused:
        (writer.replace_own if replace else writer.write_new)(target, "x" * 10_000)
    assert str(target) in str(refused.value) and "the disk is full" in str(refused.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == (["run.json"] if replace else [])
    if replace:
        assert target.read_text(encoding="utf-8") == "the old state"


def test_an_error_of_the_caller_removes_the_partial_file_and_the_reserved_name(tmp_path):
    with pytest.raises(KeyError):
        with writer.new_file(tmp_path / "report.zip") as handle:
            handle.write(b"half")
            raise KeyError("gather")
    assert list(tmp_path.iterdir()) == []


def test_a_child_process_fills_the_staged_name_with_the_target_suffix(tmp_path):
    with writer.staged(tmp_path / "telemetry.png") as temporary:
        assert temporary.suffix == ".png" and temporary.parent == tmp_path and temporary.exists()
        temporary.write_bytes(b"png")
    assert (tmp_path / "telemetry.png").read_bytes() == b"png" and len(list(tmp_path.iterdir())) == 1


@links
def test_no_link_is_followed_at_the_name_or_in_a_folder_between(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("keep", encoding="utf-8")
    root = tmp_path / "run"
    root.mkdir()
    (root / "log.txt").symlink_to(outside / "secret.txt")
    (root / "job").symlink_to(outside)
    with pytest.raises(LauncherError, match="is a link"):
        writer.write_new(root / "log.txt", "x", root)
    with pytest.raises(LauncherError, match="is a link"):
        writer.replace_own(root / "job" / "secret.txt", "x", root)
    with pytest.raises(LauncherError, match="is a link"):
        writer.open_append(root, root / "log.txt")
    assert (outside / "secret.txt").read_text(encoding="utf-8") == "keep"


def test_a_folder_is_published_only_where_nothing_stands(tmp_path):
    staging, final = tmp_path / "trainer.partial", tmp_path / "trainer"
    staging.mkdir()
    final.mkdir()
    with pytest.raises(LauncherError, match="never replaced"):
        writer.publish_folder(staging, final)
    final.rmdir()
    assert writer.publish_folder(staging, final).is_dir() and not staging.exists()


# -- the rule: every file the launcher writes is written by launcher/writer.py ---------------------

WRITING_METHODS = {"write_text", "write_bytes", "touch", "rename", "symlink_to", "hardlink_to", "savefig"}
"""Methods that create or change a file (Path's, a figure's); `replace` is left out, as str has one too."""
WRITING_FUNCTIONS = {("os", "replace"), ("os", "rename"), ("os", "symlink"), ("os", "link"), ("shutil", "copy"),
                     ("shutil", "copy2"), ("shutil", "copyfile"), ("shutil", "copytree"), ("shutil", "move"),
                     ("tempfile", "mkstemp")}
WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"}


def writes_outside_the_writer(source: str) -> list[tuple[int, str]]:
    """(line, call) of each call in `source` that writes a file itself (a folder made with mkdir is not a file)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        function = node.func
        owner = function.value.id if isinstance(function, ast.Attribute) and isinstance(function.value, ast.Name) else None
        name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
        if (owner, name) == ("os", "open"):
            flags = {item.attr for item in ast.walk(node.args[1]) if isinstance(item, ast.Attribute)} if len(node.args) > 1 else set()
            if flags & WRITE_FLAGS or not flags:
                found.append((node.lineno, "os.open"))
        elif (owner, name) in WRITING_FUNCTIONS or (name in WRITING_METHODS and isinstance(function, ast.Attribute)):
            found.append((node.lineno, f"{owner or ''}.{name}"))
        elif name == "open" and (len(node.args) > 1 or any(item.arg == "mode" for item in node.keywords)):
            mode = node.args[1] if len(node.args) > 1 else next(item.value for item in node.keywords if item.arg == "mode")
            if not (isinstance(mode, ast.Constant) and set(str(mode.value)) <= set("rbt")):
                found.append((node.lineno, "open(mode)"))
    return found


LAUNCHER_SIDE = sorted(path for path in (REPO / "launcher").rglob("*.py")
                       if path.name != "writer.py" and "in_trainer" not in path.parts)
"""The launcher's own modules. launcher/in_trainer/ runs under the trainer's interpreter and writes
only the temporary names the launcher hands it (a self-test report, a plot, the tiny assets in the
workdir), which the launcher then publishes or reads."""


@pytest.mark.parametrize("path", LAUNCHER_SIDE, ids=lambda path: path.relative_to(REPO).as_posix())
def test_every_file_the_launcher_writes_goes_through_the_writer(path):
    found = writes_outside_the_writer(path.read_text(encoding="utf-8"))
    assert not found, f"{path.relative_to(REPO)} writes a file itself at {found}: use launcher/writer.py"


def test_the_rule_sees_each_way_of_writing():
    source = ("import os, shutil\n"
              "p.write_text('x')\n"
              "open(p, 'w')\n"
              "open(p, 'rb')\n"
              "os.replace(a, b)\n"
              "shutil.copy2(a, b)\n"
              "os.open(p, os.O_WRONLY | os.O_CREAT)\n"
              "os.open(p, os.O_RDONLY)\n"
              "p.read_text()\n"
              "text.replace('a', 'b')\n")
    assert [line for line, _ in writes_outside_the_writer(source)] == [2, 3, 5, 6, 7]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")
def test_a_fifo_where_a_file_is_written_is_refused_at_once_never_waited_on(tmp_path):
    fifo = tmp_path / "run.lock"
    os.mkfifo(fifo)
    for write in (lambda: writer.open_append(tmp_path, fifo), lambda: writer.touch(tmp_path, fifo)):
        with pytest.raises(LauncherError, match="is not a regular file"):
            write()
    assert writer.replace_own(fifo, "state") and fifo.read_text(encoding="utf-8") == "state"  # replaced, not opened

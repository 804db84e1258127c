"""The files each command touches, found by running it, and the same run again with one of them damaged.

Hostile-input rules written case by case keep missing files nobody named: a state file, a
safetensors index, a trace, a flag file. Here the commands name their own surfaces: each
invocation of docs/commands.md runs once under an audit hook that records every path it opens,
writes, renames, removes or lists inside its tree (and, as stat raises no audit event, every state
file it looks for and does not find), and the matrix then runs it again with one of those paths
made hostile (FILE_, FOLDER_ and NEW_MUTATIONS), in a fresh copy of the tree, in a child process
bounded in time and memory (`python tests/surfaces.py CELL`, the end of this file).

Audit hooks cannot be removed, so one hook serves the whole test process and records only inside
`recording()`; it also sees the launcher's own threads.
"""

import builtins
import contextlib
import errno
import hashlib
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

SECRET = "planted-secret-5f1c0b"
"""Held by every file a link leads to outside the tree, and by the `secret` cells: it must reach no output."""
SECONDS = 60
MEMORY = 2**30
LONG_NAME = "n" * 296 + ".txt"
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
REPO_ROOT = Path(__file__).resolve().parent.parent

# -- recording ------------------------------------------------------------------------------------

_touches: list[tuple[str, str]] | None = None
_lock = threading.Lock()


def _paths(event: str, args: tuple) -> list[tuple[str, object]]:
    """(operation, path) pairs of one audit event; the operation says read, write, list or change."""
    if event == "open":
        path, mode, flags = args
        writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & WRITE_FLAGS)
        return [("write" if writes else "read", path)]
    if event in ("os.rename", "os.replace", "shutil.move", "shutil.copyfile", "shutil.copytree", "os.link"):
        return [("change", args[0]), ("write", args[1])]
    if event in ("os.listdir", "os.scandir"):
        return [("list", args[0])]
    if event == "os.symlink":
        return [("write", args[1])]
    if event in ("os.remove", "os.rmdir", "shutil.rmtree", "os.chmod", "os.truncate", "os.mkdir"):
        return [("change" if event != "os.mkdir" else "write", args[0])]
    return []


def _hook(event: str, args: tuple) -> None:
    if _touches is None:
        return
    for operation, path in _paths(event, args):
        if isinstance(path, (str, bytes, os.PathLike)):
            with _lock:
                _touches.append((operation, os.path.abspath(os.fsdecode(path))))


sys.addaudithook(_hook)


def _stat_recorder(stat_function):
    """os.stat or os.lstat noting its path: stat raises no audit event, and a reader that stats a
    file before opening it (launcher.user_files) never opens one that is absent."""
    def recorded(path, *args, **kwargs):
        if _touches is not None and isinstance(path, (str, bytes, os.PathLike)):
            with _lock:
                _touches.append(("stat", os.path.abspath(os.fsdecode(path))))
        return stat_function(path, *args, **kwargs)
    return recorded


@contextlib.contextmanager
def recording():
    """Every (operation, absolute path) the code inside touches."""
    global _touches
    found: list[tuple[str, str]] = []
    real = os.stat, os.lstat
    os.stat, os.lstat = map(_stat_recorder, real)
    _touches = found
    try:
        yield found
    finally:
        _touches = None
        os.stat, os.lstat = real


# -- the invocations ------------------------------------------------------------------------------


@dataclass
class Invocation:
    """One documented invocation: `build(tree)` lays out its files and returns its argv."""

    name: str
    build: Callable[[Path], list[str]]
    template: str
    """The kind of tree it runs in: built once per invocation, copied afresh for each cell."""
    free_disk: bool = False
    """Report plenty of free disk: the model files are sparse, the disk check would refuse them."""


@dataclass
class Surface:
    """A path an invocation touched, relative to its tree, and how."""

    path: str
    operations: set = field(default_factory=set)
    kind: str = "file"  # file, folder, absent (looked for, not there), or new (written by the command)
    in_argv: bool = False


def role(path: str) -> str:
    """image_0.png and image_1.png play one role; so do a run's steps: one of each is mutated."""
    return re.sub(r"\d+", "#", path)


def surfaces(tree: Path, touches: list[tuple[str, str]], argv: list[str], before: set[str]) -> list[Surface]:
    """The paths under `tree` an invocation touched, one per role, its temporary names left out."""
    found: dict[str, Surface] = {}
    roles = set()
    for operation, name in touches:
        path = Path(name)
        if tree not in path.parents or str(os.getpid()) in path.name:
            continue
        if operation == "stat" and (path.relative_to(tree).as_posix() in before or not path.name.endswith(JSONISH)):
            continue  # of what is only looked at, the state files that are not there
        rel = path.relative_to(tree).as_posix()
        if rel not in found:
            if role(rel) in roles:
                continue
            roles.add(role(rel))
            kind = ("folder" if (tree / rel).is_dir() else "file") if rel in before else "new"
            found[rel] = Surface(rel, kind=kind, in_argv=any(arg == name for arg in argv))
        found[rel].operations.add(operation)
    for surface in found.values():
        if surface.kind == "new" and surface.operations <= {"read", "stat"}:
            surface.kind = "absent"
    return list(found.values())


# -- mutations ------------------------------------------------------------------------------------


def _clear(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)


def _replace(path: Path, make) -> None:
    _clear(path)
    make(path)


def _nested(path: Path) -> None:
    depth = 100_000
    if path.suffix == ".safetensors":
        blob = ("[" * depth + "]" * depth).encode()
        path.write_bytes(len(blob).to_bytes(8, "little") + blob)
    elif path.suffix == ".jsonl":
        path.write_text("[" * depth + "]" * depth + "\n", encoding="utf-8")
    else:
        path.write_text('{"a": ' * depth + "1" + "}" * depth, encoding="utf-8")


def _outside(path: Path, outside: Path, folder: bool) -> None:
    target = outside / ("secret-folder" if folder else "secret.txt")
    _replace(path, lambda p: p.symlink_to(target, target_is_directory=folder))


def _huge(path: Path) -> None:
    with path.open("wb") as handle:
        handle.truncate(2**30)


FILE_MUTATIONS = {
    "missing": lambda path, outside: _clear(path),
    "empty": lambda path, outside: _replace(path, lambda p: p.write_bytes(b"")),
    "folder": lambda path, outside: _replace(path, lambda p: p.mkdir()),
    "fifo": lambda path, outside: _replace(path, os.mkfifo),
    "dev-zero": lambda path, outside: _replace(path, lambda p: p.symlink_to("/dev/zero")),
    "outside-link": lambda path, outside: _outside(path, outside, folder=False),
    "dangling-link": lambda path, outside: _replace(path, lambda p: p.symlink_to(outside / "nowhere" / "gone")),
    "unreadable": lambda path, outside: path.chmod(0),
    "1-gib": lambda path, outside: _replace(path, _huge),
    "nested-json": lambda path, outside: _replace(path, _nested),
    "invalid-utf8": lambda path, outside: _replace(path, lambda p: p.write_bytes(b"a: caf\xe9 \x80\xfe\n")),
    "secret": lambda path, outside: _replace(path, lambda p: p.write_text(f"{SECRET}\n", encoding="utf-8")),
}
FOLDER_MUTATIONS = {
    "missing": FILE_MUTATIONS["missing"],
    "a-file": FILE_MUTATIONS["empty"],
    "fifo": FILE_MUTATIONS["fifo"],
    "outside-link": lambda path, outside: _outside(path, outside, folder=True),
    "dangling-link": FILE_MUTATIONS["dangling-link"],
    "unreadable": lambda path, outside: path.chmod(0),
    "secret": lambda path, outside: (path / "notes.txt").write_text(SECRET, encoding="utf-8"),
}
NEW_MUTATIONS = {  # at a name the command writes: what stands there must be refused or left alone
    "folder": FILE_MUTATIONS["folder"],
    "fifo": FILE_MUTATIONS["fifo"],
    "dev-zero": FILE_MUTATIONS["dev-zero"],
    "outside-link": FILE_MUTATIONS["outside-link"],
    "dangling-link": FILE_MUTATIONS["dangling-link"],
    "user-file": lambda path, outside: _replace(path, lambda p: p.write_text(f"a user's file {SECRET}", encoding="utf-8")),
    "unwritable-parent": None,
    "full-disk": None,
}
JSONISH = (".json", ".jsonl", ".yaml", ".yml", ".safetensors")
NEEDS_A_USER = ("unreadable", "unwritable-parent")
"""chmod stops no read or write of root's: these cells are skipped when the tests run as root."""


def mutations(surface: Surface) -> list[str]:
    """The mutations that make sense for a surface."""
    if surface.kind == "new":
        names = list(NEW_MUTATIONS)
    elif surface.kind == "absent":  # a state file planted where the command looks for one
        names = [name for name in FILE_MUTATIONS if name not in ("missing", "unreadable")
                 and (name != "nested-json" or surface.path.endswith(JSONISH))]
    elif surface.kind == "folder":
        names = list(FOLDER_MUTATIONS)
    else:
        names = [name for name in FILE_MUTATIONS if name != "nested-json" or surface.path.endswith(JSONISH)]
        if surface.operations & {"write", "change"}:
            names += ["unwritable-parent", "full-disk"]
    if surface.in_argv:
        names.append("long-name")
    return names


def mutate(tree: Path, outside: Path, surface: Surface, mutation: str, argv: list[str]) -> list[str]:
    """Apply `mutation` at `surface` in `tree`; the argv to run (changed only by `long-name`)."""
    path = tree / surface.path
    if mutation == "long-name":
        return [str(path.with_name(LONG_NAME)) if arg == str(path) else arg for arg in argv]
    if mutation == "unwritable-parent":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.parent.chmod(0o555)
    elif mutation != "full-disk":
        table = {"new": NEW_MUTATIONS, "folder": FOLDER_MUTATIONS}.get(surface.kind, FILE_MUTATIONS)
        table[mutation](path, outside)
    return argv


def copy_sparse(source: str, destination: str) -> None:
    """shutil's copy_function for trees of sparse files: the data is copied, the holes stay holes
    (the model folders hold 64 GB files of nothing)."""
    with open(source, "rb") as reader, open(destination, "wb") as writer:
        size, offset = os.fstat(reader.fileno()).st_size, 0
        while offset < size:
            try:
                offset = os.lseek(reader.fileno(), offset, os.SEEK_DATA)
            except OSError:  # only a hole is left
                break
            end = os.lseek(reader.fileno(), offset, os.SEEK_HOLE)
            reader.seek(offset)
            writer.seek(offset)
            writer.write(reader.read(end - offset))
            offset = end
        writer.truncate(size)
    shutil.copymode(source, destination)


def copy_tree(source: Path, destination: Path) -> None:
    shutil.copytree(source, destination, symlinks=True, copy_function=copy_sparse)


def restore_permissions(root: Path) -> None:
    """Undo the chmod cells, so the tree can be read, compared and removed."""
    for folder, folders, files in os.walk(root):
        for name in folders + files:
            path = Path(folder) / name
            if not path.is_symlink():
                path.chmod(0o755 if path.is_dir() else 0o644)
    if root.exists():
        root.chmod(0o755)


# -- snapshots ------------------------------------------------------------------------------------


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under `root` (links not followed) with what it holds."""
    found = {}
    for folder, folders, files in os.walk(root):
        for name in folders + files:
            path = Path(folder) / name
            found[path.relative_to(root).as_posix()] = _state(path)
    return found


def _state(path: Path) -> tuple:
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        return ("link", os.readlink(path))
    if not stat.S_ISREG(info.st_mode):
        return ("folder" if stat.S_ISDIR(info.st_mode) else "other",)
    try:
        with path.open("rb") as handle:  # a sparse 1 GiB file: its size and first bytes
            return ("file", info.st_size, hashlib.sha256(handle.read(1 << 16)).hexdigest())
    except PermissionError:
        return ("file", info.st_size, "unreadable")


def changed(before: dict, after: dict) -> set[str]:
    return {name for name in before.keys() | after.keys() if before.get(name) != after.get(name)}


# -- one cell, in a child process -----------------------------------------------------------------


@dataclass
class Outcome:
    code: int | None
    output: str
    """stdout and stderr, in that order."""
    stderr: str = ""
    timed_out: bool = False


def run_cell(argv: list[str], full_disk: str | None = None, free_disk: bool = False, cwd: Path | None = None) -> Outcome:
    """`python -m launcher ARGV` in a child process bounded by SECONDS and MEMORY."""
    cell = json.dumps({"argv": argv, "full_disk": full_disk, "free_disk": free_disk})
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUTF8": "1", "LC_ALL": "C.UTF-8"}
    try:
        done = subprocess.run([sys.executable, __file__, cell], capture_output=True, timeout=SECONDS, env=env,
                              cwd=cwd or REPO_ROOT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as expired:
        text = (expired.stdout or b"") + (expired.stderr or b"")
        return Outcome(None, text.decode("utf-8", "replace"), timed_out=True)
    stderr = done.stderr.decode("utf-8", "replace")
    return Outcome(done.returncode, done.stdout.decode("utf-8", "replace") + stderr, stderr)


class FullFile:
    """A file being written on a full disk: half of the first write lands, then ENOSPC."""

    def __init__(self, handle, name: str) -> None:
        self._handle = handle
        self._name = name

    def write(self, data):
        self._handle.write(data[: len(data) // 2])
        self._handle.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._name)

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._handle.close()

    def __iter__(self):
        return iter(self._handle)


def fill_disk_at(target: str) -> None:
    """Make every write to `target` fail as on a full disk, after half of its first write."""
    real_open, real_write = io.open, os.write

    def name_of(file) -> str:
        if isinstance(file, int):
            with contextlib.suppress(OSError):
                return os.readlink(f"/proc/self/fd/{file}")
            return ""
        return os.path.abspath(os.fsdecode(file))

    def full_open(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        writes = any(c in mode for c in "wax+")
        return FullFile(handle, target) if writes and name_of(file) == target else handle

    def full_write(fd, data):
        if name_of(fd) == target:
            real_write(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), target)
        return real_write(fd, data)

    builtins.open = io.open = full_open
    os.write = full_write


def cell_main(cell: dict) -> int:
    """The child's side: bound the memory, fill the disk where asked, run the launcher."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
    if cell["full_disk"]:
        fill_disk_at(cell["full_disk"])
    if cell["free_disk"]:
        from launcher.runs import disk_budget

        disk_budget.free_disk_gib = lambda path: 500.0
    from launcher.cli import main

    return main(cell["argv"])


if __name__ == "__main__":
    sys.exit(cell_main(json.loads(sys.argv[1])))

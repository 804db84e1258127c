"""Writes that never follow a link out of their folder.

A link planted at `train.log`, at a telemetry file, at the job folder or at a `.partial` name
would otherwise make the launcher append to, or overwrite, whatever the link points at. Every
file the launcher writes in a run folder (and in ComfyUI's models/loras) is opened here: each
path component below the folder is checked with lstat (links and Windows junctions refused),
and the file itself is opened with O_NOFOLLOW where the platform has it (POSIX), or created
with O_EXCL, which never follows a link on any platform.
"""

import os
from pathlib import Path

from launcher.errors import LauncherError

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
BINARY = getattr(os, "O_BINARY", 0)  # Windows: no newline translation


def is_link(path: Path) -> bool:
    """A symbolic link, or on Windows a junction (which is_symlink does not report)."""
    is_junction = getattr(path, "is_junction", None)  # Python 3.12+, Windows junctions
    return path.is_symlink() or bool(is_junction and is_junction())


def link_error(path: Path) -> LauncherError:
    try:
        target = f" (to {os.readlink(path)})"
    except OSError:
        target = ""
    return LauncherError(f"{path} is a link{target}; the launcher does not write through links, which could "
                         "lead out of the run folder. Remove the link (a plain file or folder of that name is fine)")


def first_link(root: Path, path: Path) -> Path | None:
    """The first of the folders between `root` and `path` (and `path` itself) that is a link, or None."""
    current = root
    for part in path.relative_to(root).parts:
        current = current / part
        if is_link(current):
            return current
    return None


def refuse_links(root: Path, path: Path) -> Path:
    """`path`, after checking that neither it nor any folder between `root` and it is a link."""
    link = first_link(root, path)
    if link is not None:
        raise link_error(link)
    return path


def _open(root: Path, path: Path, flags: int, what: str) -> int:
    refuse_links(root, path)
    try:
        return os.open(path, flags | NOFOLLOW | BINARY, 0o666)
    except OSError as error:
        if is_link(path):  # ELOOP from O_NOFOLLOW, EEXIST from O_EXCL
            raise link_error(path) from None
        raise LauncherError(f"cannot {what} {path} ({error.strerror or error}); check that its folder is "
                            "writable and the disk is not full") from None


def open_append(root: Path, path: Path, text: bool = False):
    """`path` (inside `root`) opened for appending, created when missing."""
    descriptor = _open(root, path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "append to")
    return os.fdopen(descriptor, "a", encoding="utf-8") if text else os.fdopen(descriptor, "ab")


def create_new(root: Path, path: Path, mode: str = "wb"):
    """A fresh file at `path` (inside `root`); whatever stood there (a stale file or a link) is removed first."""
    refuse_links(root, path.parent)
    path.unlink(missing_ok=True)  # removes a link itself, never its target
    descriptor = _open(root, path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, "create")
    return os.fdopen(descriptor, mode, **({"encoding": "utf-8", "newline": "\n"} if "b" not in mode else {}))


def create_exclusive(root: Path, path: Path):
    """A new binary file at `path` (inside `root`); whatever stands there, a file or a link, makes it fail
    with a LauncherError, and nothing is removed."""
    if path.exists() or is_link(path):
        raise LauncherError(f"{path} exists; it is never overwritten: give another name")
    return os.fdopen(_open(root, path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, "create"), "wb")


def touch(root: Path, path: Path) -> Path:
    """Create `path` (inside `root`) when missing, without following a link."""
    os.close(_open(root, path, os.O_WRONLY | os.O_CREAT, "create"))
    return path

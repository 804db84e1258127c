"""Links between a folder and a file: found with lstat, never followed.

A link planted at `train.log`, at a telemetry file, at the job folder or at a `.partial` name
would otherwise make the launcher read or write whatever the link points at. The writer
(launcher/writer.py) and the reader (launcher/user_files.py) check every path component below
the folder they are given here (links and Windows junctions alike).
"""

import os
from pathlib import Path

from launcher.errors import LauncherError


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
                         "lead out of the folder it writes in. Remove the link (a plain file or folder of that name is fine)")


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

"""The one exception type the command line turns into a clean message, and the lines it gives to
what else reaches it."""

import errno
import sys
import tempfile
import traceback
from pathlib import Path


class LauncherError(Exception):
    """A problem the user can fix; the message says what is wrong and how to fix it."""


WHAT_TO_DO = {
    errno.ENOSPC: "the disk is full: free some space and run the command again",
    errno.EACCES: "permission denied: give your user access to it, or pick another folder",
    errno.EPERM: "the system refused the operation: give your user access to it, or pick another folder",
    errno.ENOENT: "it does not exist: check the path",
    errno.ENAMETOOLONG: "the name is too long: pick a shorter folder or name",
    errno.EROFS: "the file system is read-only: pick another folder",
    errno.EISDIR: "it is a folder where a file belongs: name a file",
    errno.ENOTDIR: "a part of the path is a file where a folder belongs: check the path",
}
TRACEBACK_FILE = Path(tempfile.gettempdir()) / "flux2-24gb-traceback.txt"
"""Where an unexpected error's whole traceback goes: the terminal gets one line."""


def os_error_line(error: OSError) -> str:
    """One line naming the file and what to do, for an OSError that no command turned into its own."""
    names = " -> ".join(str(name) for name in (error.filename, error.filename2) if name is not None)
    advice = WHAT_TO_DO.get(error.errno, "check the path, its permissions and the free space")
    return f"{names or 'a file'}: {error.strerror or error}; {advice}"


def unexpected_error_line(error: BaseException) -> str:
    """A bug's one line: the full traceback is kept in a file for the bug report, not thrown at the user."""
    from launcher.writer import replace_own  # the writer reports its own failures as LauncherErrors

    where = TRACEBACK_FILE
    try:
        replace_own(where, "".join(traceback.format_exception(error)))
    except (OSError, LauncherError):
        where = None
        traceback.print_exception(error, file=sys.stderr)
    kind = type(error).__name__
    kept = f"; the traceback is in {where}" if where else ""
    return (f"an unexpected {kind} stopped the command (a bug of the launcher){kept}; "
            f"`python -m launcher report` gathers what a bug report needs")

"""The lengths a file system allows, checked on the longest files a run will write before any work
starts: a run that trains for hours must not end at its first save on a name the disk refuses.

A file name may have 255 bytes in UTF-8 on Linux and macOS, 255 UTF-16 units on Windows (NTFS).
A whole path on Windows may have 259 characters (MAX_PATH, 260 with its terminating NUL) unless
the machine has long paths on (LongPathsEnabled, which Python's own manifest honours); past it the
trainer's save fails with a misleading "No such file or directory".
"""

import sys
from pathlib import Path

from launcher.errors import LauncherError

NAME_LIMIT = 255
WINDOWS_MAX_PATH = 259
LONG_PATHS_KEY = r"SYSTEM\CurrentControlSet\Control\FileSystem"
LONG_PATHS_HOW = ("or turn on Windows' long paths (Group Policy: Computer Configuration > Administrative Templates > "
                  "System > Filesystem > Enable Win32 long paths; or the registry value LongPathsEnabled = 1 under "
                  rf"HKLM\{LONG_PATHS_KEY}) and start a new terminal")


def long_paths_enabled() -> bool:
    """Whether Windows lets this process use paths past MAX_PATH (False when it cannot tell)."""
    try:
        import winreg
        with winreg.OpenKey(winreg.HKEY_LOCAL_MACHINE, LONG_PATHS_KEY) as key:
            return winreg.QueryValueEx(key, "LongPathsEnabled")[0] == 1
    except (ImportError, OSError):
        return False


def name_length(name: str, windows: bool) -> int:
    """A name's length as the platform's file system counts it."""
    return len(name.encode("utf-16-le")) // 2 if windows else len(name.encode("utf-8", errors="surrogateescape"))


def on_windows() -> bool:
    return sys.platform == "win32"


def check_lengths(paths: list[Path]) -> None:
    """Refuse, in one line naming the path, the first of `paths` the file system would refuse."""
    windows = on_windows()
    unit = "characters" if windows else "bytes"
    for path in paths:
        for part in path.parts:
            if name_length(part, windows) > NAME_LIMIT:
                raise LauncherError(f"{path}: the name {part[:40]}... has {name_length(part, windows)} {unit}; a file "
                                    f"system allows {NAME_LIMIT}: shorten the run name (config.name) or the folder")
        if windows and len(str(path)) > WINDOWS_MAX_PATH and not long_paths_enabled():
            raise LauncherError(f"{path} would have {len(str(path))} characters, past Windows' {WINDOWS_MAX_PATH} "
                                f"(MAX_PATH): pick a shorter --output or run name, {LONG_PATHS_HOW}")

"""Wine stand-ins for the Windows CPython that `.ci/windows.sh` runs the tests with.

`.ci/windows.sh` copies this file next to that interpreter only; it is no part of the launcher.
Each stand-in covers a call that Wine 8.0 lacks or fakes, and makes it behave as Windows does:

- `_wmi` needs `propsys.VariantToString`, which Wine lacks: the process dies in `platform.uname()`.
  Without `_wmi`, `platform` falls back to its other sources, as on a Windows without WMI.
- `CopyFile2` is missing from Wine's kernel32: `shutil.copy2` kills the process. Without
  `_winapi.CopyFile2`, `shutil` copies the bytes itself.
- `CreateSymbolicLinkW` reports success and creates nothing: `os.symlink` raises what Windows
  raises for a user without the symlink privilege (WinError 1314).
- no git.exe: GitPython imports without it (its commands fail when called).
"""

import os
import sys

import _winapi

sys.modules["_wmi"] = None  # import _wmi raises ImportError
if hasattr(_winapi, "CopyFile2"):
    del _winapi.CopyFile2


def _symlink(src, dst, target_is_directory=False, *, dir_fd=None):
    raise OSError(22, "A required privilege is not held by the client", str(src), 1314, str(dst))


os.symlink = _symlink
os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")

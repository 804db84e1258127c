"""Host memory, swap/pagefile and disk, with the standard library only (Linux, Windows, macOS)."""

import ctypes
import os
import shutil
import sys
from pathlib import Path


def memory_gib() -> dict[str, float | None]:
    """Total and available RAM and swap (pagefile on Windows) in GiB; None where unknown."""
    if sys.platform == "win32":
        return _windows_memory()
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        values = {}
        for line in meminfo.read_text().splitlines():
            key, _, rest = line.partition(":")
            values[key] = int(rest.split()[0]) / 2**20  # kB -> GiB
        return {
            "ram_total": round(values.get("MemTotal", 0), 2),
            "ram_available": round(values.get("MemAvailable", 0), 2),
            "swap_total": round(values.get("SwapTotal", 0), 2),
            "swap_free": round(values.get("SwapFree", 0), 2),
        }
    return {"ram_total": None, "ram_available": None, "swap_total": None, "swap_free": None}


def _windows_memory() -> dict[str, float | None]:
    class MemoryStatus(ctypes.Structure):
        _fields_ = [
            ("dwLength", ctypes.c_ulong), ("dwMemoryLoad", ctypes.c_ulong),
            ("ullTotalPhys", ctypes.c_ulonglong), ("ullAvailPhys", ctypes.c_ulonglong),
            ("ullTotalPageFile", ctypes.c_ulonglong), ("ullAvailPageFile", ctypes.c_ulonglong),
            ("ullTotalVirtual", ctypes.c_ulonglong), ("ullAvailVirtual", ctypes.c_ulonglong),
            ("ullAvailExtendedVirtual", ctypes.c_ulonglong),
        ]

    status = MemoryStatus()
    status.dwLength = ctypes.sizeof(MemoryStatus)
    ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status))
    gib = 2**30
    # The "page file" figures are the commit limit: RAM plus pagefile.
    return {
        "ram_total": round(status.ullTotalPhys / gib, 2),
        "ram_available": round(status.ullAvailPhys / gib, 2),
        "swap_total": round((status.ullTotalPageFile - status.ullTotalPhys) / gib, 2),
        "swap_free": round(max(0, status.ullAvailPageFile - status.ullAvailPhys) / gib, 2),
    }


def free_disk_gib(path: Path) -> float:
    """Free space on the volume holding `path` (or its nearest existing parent)."""
    for candidate in [path, *path.parents]:
        if candidate.exists():
            return round(shutil.disk_usage(candidate).free / 2**30, 2)
    return round(shutil.disk_usage(os.getcwd()).free / 2**30, 2)

"""Host memory, swap/pagefile, disk and the GPU driver, with the standard library only (Linux, Windows, macOS)."""

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path


def memory_gib() -> dict[str, float | None]:
    """Total and available RAM and swap (pagefile on Windows) in GiB; None where unknown."""
    if sys.platform == "win32":
        return _windows_memory()
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        values = {}
        for line in meminfo.read_text(encoding="utf-8").splitlines():
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


DRIVER_QUERIES = (
    # (tool, arguments, how to read its output); the first that answers wins
    ("nvidia-smi", ["--query-gpu=driver_version", "--format=csv,noheader"], lambda out: out.splitlines()[0]),
    ("amd-smi", ["version"], lambda out: out.strip()),  # Linux ROCm 6.1+: tool, library and amdgpu versions
    ("rocm-smi", ["--showdriverversion"], lambda out: next(
        (line.split(":", 1)[1] for line in out.splitlines() if "version" in line.lower() and ":" in line), "")),
    ("powershell", ["-NoProfile", "-Command",
                    "(Get-CimInstance Win32_VideoController | ForEach-Object { $_.Name + ' ' + $_.DriverVersion }) -join '; '"],
     lambda out: out.strip()),
)


def gpu_driver_version(timeout: float = 15) -> str | None:
    """The GPU driver's version as the vendor tool (or Windows) reports it; None when none answers.
    Only nvidia-smi is tested (Linux); the AMD and Windows queries follow the tools' documentation."""
    for tool, arguments, read in DRIVER_QUERIES:
        if tool == "powershell" and sys.platform != "win32":
            continue
        found = shutil.which(tool)
        if not found:
            continue
        try:
            result = subprocess.run([found, *arguments], capture_output=True, text=True, encoding="utf-8", errors="replace",
                                    timeout=timeout)
            text = read(result.stdout).strip() if result.returncode == 0 else ""
        except (OSError, subprocess.SubprocessError, StopIteration, IndexError):
            text = ""
        if text:
            return f"{text} ({tool})"[:300]
    return None

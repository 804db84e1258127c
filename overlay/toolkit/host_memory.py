"""The trainer's host memory: resident and peak resident size, and handing freed heap back.

Loading a 32B transformer block by block allocates and frees tens of GB of short-lived
tensors. Python and torch free them, but the C heap may keep the pages: glibc's malloc
serves allocations under its dynamic mmap threshold (at most 32 MB) from arenas that only
shrink from the top, and the Windows CRT heap keeps coalesced free blocks committed. Both
have a call that returns free pages to the OS; release_freed_memory() makes it where the
platform has one and does nothing elsewhere.

Peak RSS is what decides whether a run needs a pagefile: VmHWM on Linux (the kernel's
high-water mark of the resident set), PeakWorkingSetSize on Windows, ru_maxrss elsewhere.
Every function here is safe to call on any platform; an unknown figure is None.
"""

import ctypes
import gc
import os
import sys
from typing import Callable, Optional

_PROC_STATUS = "/proc/self/status"


def _proc_status_bytes(field: str) -> Optional[int]:
    """A "kB" line of /proc/self/status in bytes (Linux), or None."""
    try:
        with open(_PROC_STATUS, encoding="ascii") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class _ProcessMemoryCounters(ctypes.Structure):
    _fields_ = [
        ("cb", ctypes.c_ulong),
        ("PageFaultCount", ctypes.c_ulong),
        ("PeakWorkingSetSize", ctypes.c_size_t),
        ("WorkingSetSize", ctypes.c_size_t),
        ("QuotaPeakPagedPoolUsage", ctypes.c_size_t),
        ("QuotaPagedPoolUsage", ctypes.c_size_t),
        ("QuotaPeakNonPagedPoolUsage", ctypes.c_size_t),
        ("QuotaNonPagedPoolUsage", ctypes.c_size_t),
        ("PagefileUsage", ctypes.c_size_t),
        ("PeakPagefileUsage", ctypes.c_size_t),
    ]


def _windows_counters() -> Optional[_ProcessMemoryCounters]:
    """GetProcessMemoryInfo for this process (psapi via kernel32's K32 export), or None."""
    try:
        kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)
        get_info = kernel32.K32GetProcessMemoryInfo
        get_info.argtypes = [ctypes.c_void_p, ctypes.POINTER(_ProcessMemoryCounters), ctypes.c_ulong]
        get_info.restype = ctypes.c_int
        kernel32.GetCurrentProcess.restype = ctypes.c_void_p
        counters = _ProcessMemoryCounters()
        counters.cb = ctypes.sizeof(counters)
        if get_info(kernel32.GetCurrentProcess(), ctypes.byref(counters), counters.cb):
            return counters
    except (AttributeError, OSError):
        pass
    return None


def current_rss_bytes() -> Optional[int]:
    """Resident set size now (Linux VmRSS, Windows WorkingSetSize), or None."""
    if sys.platform.startswith("linux"):
        return _proc_status_bytes("VmRSS")
    if os.name == "nt":
        counters = _windows_counters()
        return counters.WorkingSetSize if counters else None
    return None


def peak_rss_bytes() -> Optional[int]:
    """Highest resident set size of this process so far, or None when the platform has no figure."""
    if sys.platform.startswith("linux"):
        return _proc_status_bytes("VmHWM")
    if os.name == "nt":
        counters = _windows_counters()
        return counters.PeakWorkingSetSize if counters else None
    try:
        import resource

        # macOS reports bytes, the BSDs kilobytes
        scale = 1 if sys.platform == "darwin" else 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    except (ImportError, OSError):
        return None


def _heap_trimmer() -> Optional[Callable[[], object]]:
    """The C heap's "give free pages back" call of this platform, or None.

    glibc: malloc_trim(0) (musl and others lack the symbol). Windows: the UCRT's _heapmin,
    which compacts the CRT heap (HeapCompact) and decommits large free blocks.
    """
    try:
        if os.name == "nt":
            return ctypes.CDLL("ucrtbase")._heapmin
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
        trim.argtypes = [ctypes.c_size_t]
        trim.restype = ctypes.c_int
        return lambda: trim(0)
    except (AttributeError, OSError):
        return None


_trimmer = None  # resolved on first use; False when the platform has none


def release_freed_memory(collect: bool = True) -> bool:
    """Collect garbage, then return the C heap's free pages to the OS where the platform can.

    Called after each transformer block is loaded: without it, RSS after a block-by-block
    load grows to about the size of the file read, although only the quantized model is
    referenced. Returns whether a heap trim ran.
    """
    global _trimmer
    if collect:
        gc.collect()
    if _trimmer is None:
        _trimmer = _heap_trimmer() or False
    if not _trimmer:
        return False
    _trimmer()
    return True


def release_pinned_cache() -> None:
    """Free the pinned (page-locked) host blocks torch's GPU host allocator keeps cached.

    Pinned buffers are cached for reuse once freed, never returned by themselves; after a
    load's staging buffers are done with, that is host RAM held for nothing.
    """
    import torch

    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available():
        empty()

"""The trainer leaves with its launcher.

`run` holds the run folder's lock (launcher/runs/run_lock.py) while its trainer lives. A
launcher killed with kill -9, or by closing its console, releases that lock at once; without
more, the trainer trained on until its next write to the closed pipe (seconds, or minutes in a
silent load phase), and a second `run` could start on the same folder meanwhile. So the
trainer is tied to the launcher by the operating system:

- Linux: the child asks the kernel for SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG,
  between fork and exec), and exits at once if the parent is already gone.
- Windows: the child is put in a job object that kills its processes when the launcher's last
  handle to it closes (JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE), which the system does when the
  launcher ends, however it ends.
- Elsewhere (macOS): nothing; the pipe still ends the trainer at its next output line.
"""

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1
JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE = 0x2000
JOB_OBJECT_EXTENDED_LIMIT_INFORMATION_CLASS = 9


def popen_options() -> dict:
    """Keyword arguments for subprocess.Popen that tie the child to this process (Linux)."""
    if not sys.platform.startswith("linux"):
        return {}
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork
    parent = os.getpid()

    def die_with_parent() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the call above
            os._exit(1)

    return {"preexec_fn": die_with_parent}


def bind(child: subprocess.Popen) -> object | None:
    """On Windows, the job object that kills `child` when this process ends (it holds the only
    handle: the system closes it with the launcher); `release` it once the trainer has ended."""
    if os.name != "nt":
        return None
    return _kill_on_close_job(int(child._handle))  # noqa: SLF001 - Popen's process handle


def release(job) -> None:
    """Close the job object of a trainer that has ended (None: nothing to close)."""
    if job is not None:
        from ctypes import wintypes

        close = ctypes.WinDLL("kernel32").CloseHandle
        close.argtypes = [wintypes.HANDLE]
        close(job)


def _kill_on_close_job(process_handle: int):
    from ctypes import wintypes

    class BasicLimits(ctypes.Structure):
        _fields_ = [("PerProcessUserTimeLimit", ctypes.c_int64), ("PerJobUserTimeLimit", ctypes.c_int64),
                    ("LimitFlags", wintypes.DWORD), ("MinimumWorkingSetSize", ctypes.c_size_t),
                    ("MaximumWorkingSetSize", ctypes.c_size_t), ("ActiveProcessLimit", wintypes.DWORD),
                    ("Affinity", ctypes.c_size_t), ("PriorityClass", wintypes.DWORD),
                    ("SchedulingClass", wintypes.DWORD)]

    class IoCounters(ctypes.Structure):
        _fields_ = [(name, ctypes.c_uint64) for name in (
            "ReadOperationCount", "WriteOperationCount", "OtherOperationCount",
            "ReadTransferCount", "WriteTransferCount", "OtherTransferCount")]

    class ExtendedLimits(ctypes.Structure):
        _fields_ = [("BasicLimitInformation", BasicLimits), ("IoInfo", IoCounters),
                    ("ProcessMemoryLimit", ctypes.c_size_t), ("JobMemoryLimit", ctypes.c_size_t),
                    ("PeakProcessMemoryUsed", ctypes.c_size_t), ("PeakJobMemoryUsed", ctypes.c_size_t)]

    kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)
    kernel32.CreateJobObjectW.restype = wintypes.HANDLE
    kernel32.CreateJobObjectW.argtypes = [ctypes.c_void_p, wintypes.LPCWSTR]
    kernel32.SetInformationJobObject.argtypes = [wintypes.HANDLE, ctypes.c_int, ctypes.c_void_p, wintypes.DWORD]
    kernel32.AssignProcessToJobObject.argtypes = [wintypes.HANDLE, wintypes.HANDLE]
    job = kernel32.CreateJobObjectW(None, None)
    limits = ExtendedLimits()
    limits.BasicLimitInformation.LimitFlags = JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE
    if not (job and kernel32.SetInformationJobObject(job, JOB_OBJECT_EXTENDED_LIMIT_INFORMATION_CLASS,
                                                     ctypes.byref(limits), ctypes.sizeof(limits))
            and kernel32.AssignProcessToJobObject(job, process_handle)):
        return None  # e.g. a launcher inside a job that forbids nesting: the pipe still ends the trainer
    return job

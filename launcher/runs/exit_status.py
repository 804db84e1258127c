"""The trainer's exit status in words, and the code `run` exits with.

`run` exits with the trainer's own code. A trainer killed by a signal (POSIX) has none; the
launcher then exits 128 + the signal number, as a shell does, and says which signal it was and
what usually sends it. On Windows a crash is an NTSTATUS code, named the same way.
"""

import signal

SIGNAL_HINTS = {
    "SIGKILL": "killed outright: usually the out-of-memory killer (see `dmesg` or the system journal)",
    "SIGSEGV": "a crash inside native code (GPU driver, a compiled extension)",
    "SIGBUS": "a crash inside native code, or a memory-mapped file that shrank",
    "SIGABRT": "a native library aborted",
    "SIGTERM": "asked to stop by another process",
    "SIGINT": "interrupted (Ctrl-C)",
    "SIGHUP": "its terminal closed",
}
NTSTATUS = {
    0xC0000005: "an access violation (a crash inside native code, often the GPU driver)",
    0xC00000FD: "a stack overflow",
    0xC0000409: "a fail-fast abort in native code",
    0xC0000017: "out of memory",
    0xC000001D: "an illegal instruction (a build for another CPU)",
    0xC0000374: "heap corruption in native code",
    0xC000013A: "Ctrl-C",
}


def describe(code: int) -> str:
    """What happened to a process that ended with `code` (Popen.returncode)."""
    if code == 0:
        return "the trainer finished (exit code 0)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = SIGNAL_HINTS.get(name, "")
        return f"the trainer was killed by {name} ({-code})" + (f": {hint}" if hint else "")
    status = code & 0xFFFFFFFF
    if status in NTSTATUS:
        return f"the trainer crashed with {status:#010X}: {NTSTATUS[status]}"
    return f"the trainer exited with code {code}"


def launcher_code(code: int) -> int:
    """The launcher's own exit code: the trainer's, or 128 + the signal that killed it."""
    return 128 - code if code < 0 else code

"""Torch channels: the one place that pins a torch/torchvision/torchaudio trio per platform.

The fork imports torchaudio without listing it, so the trio is always installed together.
After the trio is in, a constraints file pins exactly what was installed, and every
later pip pass uses it: an unpinned transitive `torch` would otherwise let pip swap the
build for another one silently.
"""

import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from launcher.errors import LauncherError
from launcher.progress import say

TRIO = ("torch", "torchvision", "torchaudio")


@dataclass(frozen=True)
class Channel:
    name: str
    versions: dict[str, str]  # package -> exact version; empty = the index's newest trio
    index_url: str | None  # None = PyPI
    note: str


CHANNELS = {
    "cuda": Channel(
        "cuda",
        {"torch": "2.11.0", "torchvision": "0.26.0", "torchaudio": "2.11.0"},
        None,
        "PyPI build with CUDA libraries (also runs on the CPU); known good",
    ),
    "rocm": Channel(
        "rocm",
        {"torch": "2.11.0", "torchvision": "0.26.0", "torchaudio": "2.11.0"},
        "https://download.pytorch.org/whl/rocm7.1",
        "PyTorch's ROCm index for Linux",
    ),
    "rocm-windows": Channel(
        "rocm-windows",
        {},
        "https://rocm.nightlies.amd.com/v2/gfx110X-all/",
        "AMD TheRock nightly wheels for gfx110X (RX 7900 XTX); the index's newest trio, "
        "pinned in the constraints file once installed",
    ),
    "cpu": Channel(
        "cpu",
        {"torch": "2.11.0", "torchvision": "0.26.0", "torchaudio": "2.11.0"},
        "https://download.pytorch.org/whl/cpu",
        "PyTorch's CPU-only index",
    ),
    "current": Channel("current", {}, None, "keep the torch installed in --python"),
}

CHANNEL_CHOICES = ("auto", *CHANNELS)


def detect_channel(system: str | None = None, which=shutil.which) -> tuple[str, str]:
    """Pick a channel from the OS and the GPU tools on PATH; return it and the reason."""
    system = system or platform.system()
    if which("nvidia-smi"):
        return "cuda", "nvidia-smi found: NVIDIA GPU"
    if system == "Windows" and (which("hipinfo") or which("amd-smi") or _windows_has_amd_gpu()):
        return "rocm-windows", "Windows with an AMD GPU"
    if system == "Linux" and (which("rocminfo") or which("amd-smi") or which("rocm-smi")):
        return "rocm", "ROCm tools found on Linux"
    return "cuda", "no GPU tools found: PyPI build, which also runs on the CPU"


def _windows_has_amd_gpu() -> bool:
    """Ask Windows for its display adapters (no extra package needed)."""
    try:
        names = subprocess.run(
            ["powershell", "-NoProfile", "-Command",
             "(Get-CimInstance Win32_VideoController).Name"],
            capture_output=True, text=True, timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(word in names for word in ("AMD", "Radeon"))


def resolve_channel(choice: str) -> Channel:
    if choice == "auto":
        name, reason = detect_channel()
        say(f"torch channel: {name} ({reason}); override with --torch-channel")
        return CHANNELS[name]
    if choice not in CHANNELS:
        raise LauncherError(f"unknown torch channel {choice!r}; choose one of {', '.join(CHANNEL_CHOICES)}")
    return CHANNELS[choice]


def trio_install_args(channel: Channel) -> list[str]:
    """pip arguments that install the channel's trio."""
    specs = [f"{pkg}=={channel.versions[pkg]}" if channel.versions else pkg for pkg in TRIO]
    index = ["--index-url", channel.index_url] if channel.index_url else []
    return [*specs, *index]


def installed_trio(python: Path) -> dict[str, str]:
    """Versions of the trio importable by `python`; missing packages are left out."""
    probe = (
        "import importlib.metadata as m, json\n"
        "found = {}\n"
        f"for name in {TRIO!r}:\n"
        "    try: found[name] = m.version(name)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(found))\n"
    )
    result = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, env=clean_env())
    if result.returncode != 0:
        raise LauncherError(f"{python} could not report its packages: {result.stderr.strip()}")
    return json.loads(result.stdout)


def constraints_text(versions: dict[str, str]) -> str:
    """Pins for every later pip pass. `==X` without a local label also matches X+cu130 etc."""
    lines = [f"{pkg}=={version.split('+', 1)[0]}\n" for pkg, version in sorted(versions.items())]
    return "# written by `python -m launcher setup`: holds the torch trio on every pip pass\n" + "".join(lines)


NO_BYTECODE = {"PYTHONDONTWRITEBYTECODE": "1"}
"""For every Python started in the trainer checkout: no `__pycache__` is written there, so `verify`
can report any bytecode in it as foreign (Python would run it in place of the source)."""


def clean_env() -> dict[str, str]:
    """The environment for pip and python subprocesses, without variables that redirect them.

    PYTHONPATH/PYTHONHOME, an active conda/pyenv/venv, or PIP_TARGET/PIP_PREFIX/PIP_USER
    from the user's shell would make the venv's pip install into, or import from,
    somewhere else. Index, proxy and certificate settings are kept: they are how the
    user's machine reaches a package index at all.
    """
    blocked = {
        "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "VIRTUAL_ENV",
        "PIP_TARGET", "PIP_PREFIX", "PIP_USER", "PIP_ROOT", "PIP_CONSTRAINT",
        "PIP_REQUIRE_VIRTUALENV",
    }
    blocked_prefixes = ("CONDA_", "PYENV_VERSION")
    return {
        key: value for key, value in os.environ.items()
        if key not in blocked and not key.startswith(blocked_prefixes)
    }


def default_python() -> Path:
    return Path(sys.executable)

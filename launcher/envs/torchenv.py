"""Torch channels: the one place that pins a torch/torchvision/torchaudio trio per platform.

The fork imports torchaudio without listing it, so the trio is always installed together.
After the trio is in, a constraints file pins exactly what was installed, and every
later pip pass uses it: an unpinned transitive `torch` would otherwise let pip swap the
build for another one silently. A channel's Triton pin (Windows has no Triton in the
torch wheels) is installed right after the trio and held the same way.
"""

import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from launcher.envs import requirement_overrides
from launcher.envs.amdgpu import pick_target, windows_adapter_names
from launcher.errors import LauncherError
from launcher.progress import say

TRIO = ("torch", "torchvision", "torchaudio")


@dataclass(frozen=True)
class Channel:
    name: str
    versions: dict[str, str]  # package -> exact version; empty = the index's newest trio
    index_url: str | None  # None = PyPI
    note: str
    triton: dict[str, str] = field(default_factory=dict)  # package -> exact version, from PyPI after the trio
    device: str | None = None  # AMD multi-arch wheels: the gfx target whose kernels torch/torchvision pull in
    # package -> exact version that replaces the trainer requirements' own pin (requirement_overrides.py)
    requirement_overrides: dict[str, str] = field(default_factory=dict)


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
        "PyTorch's ROCm index for Linux; torch 2.11.0+rocm7.1 brings its own Triton (triton-rocm 3.6.0)",
    ),
    # AMD's stable multi-arch index (ROCm 10.0.0): one index for every GPU, the kernels of one target
    # per `[device-gfxNNNN]` extra; Windows gets torch 2.13 only there. See the AMD docs "Install
    # PyTorch" (ai-ecosystem), rocm-ver 10.0.0. Triton 3.7 is the Triton of torch 2.13 (triton-windows'
    # PyTorch/Triton table); 3.7.1.post27 ships the AMD backend.
    # ROCm 10.0.0, not 10.1.0: on Windows, 10.1 builds returned hipErrorInvalidValue and zero SDPA
    # output from AOTriton where 7.15 worked (ROCm/aotriton#210, 2026-08), and no public report of
    # triton-windows 3.7 on 10.1 was found; torch stays 2.13 (triton-windows' table: 2.13 -> 3.7).
    # 10.0.0's open kernel-launch crash is reported on gfx1200 (ROCm/TheRock#7727), not on gfx1100.
    # Revisit with the first 7900 XTX report. The SDK wheels follow this pin
    # (rocm[libraries,devel]==10.0.0, launcher/envs/rocm_windows_toolchain.py).
    "rocm-windows": Channel(
        "rocm-windows",
        {"torch": "2.13.0+rocm10.0.0", "torchvision": "0.28.0+rocm10.0.0", "torchaudio": "2.11.0.2+rocm10.0.0"},
        "https://stable.repo.amd.com/rocm/whl-next/",
        "AMD's stable multi-arch ROCm 10.0.0 wheels for RX 7000 (gfx110X) and RX 9000 (gfx120X)",
        triton={"triton-windows": "3.7.1.post27"},
        requirement_overrides={
            # torch 2.13.0 requires setuptools>=77.0.3: the fork's setuptools==69.5.1 makes pip's
            # resolution impossible. 80.9.0 keeps pkg_resources (removed in 82.0.0), which clip
            # (`from pkg_resources import packaging`) and pytorch_wavelets still import.
            "setuptools": "80.9.0",
            # 0.2.4 builds its CUDA extension wherever torch.cuda.is_available() (ROCm too: a hipcc JIT
            # build retried on every qint2/qint4 unpack, then the Python fallback) and reads
            # torch.version.cuda (None on ROCm) for bf16 qint4 weights; 0.2.7 builds it on Linux only
            # (huggingface/optimum-quanto#365) and checks torch.version.cuda first. docs/testing.md.
            "optimum-quanto": "0.2.7",
        },
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
MULTI_ARCH = {"rocm-windows"}  # channels whose torch needs a GPU target picked


def detect_channel(system: str | None = None, which=shutil.which) -> tuple[str, str]:
    """Pick a channel from the OS and the GPU tools on PATH; return it and the reason."""
    system = system or platform.system()
    if which("nvidia-smi"):
        return "cuda", "nvidia-smi found: NVIDIA GPU"
    if system == "Windows" and (which("hipinfo") or which("amd-smi") or _has_amd_adapter()):
        return "rocm-windows", "Windows with an AMD GPU"
    if system == "Linux" and (which("rocminfo") or which("amd-smi") or which("rocm-smi")):
        return "rocm", "ROCm tools found on Linux"
    return "cuda", "no GPU tools found: PyPI build, which also runs on the CPU"


def _has_amd_adapter() -> bool:
    return any(word in name for name in windows_adapter_names() for word in ("AMD", "Radeon"))


def resolve_channel(choice: str, amd_arch: str = "auto") -> Channel:
    """The channel to install; a multi-arch one gets its GPU target (from --amd-arch or the adapter names)."""
    if choice == "auto":
        choice, reason = detect_channel()
        say(f"torch channel: {choice} ({reason}); override with --torch-channel")
    if choice not in CHANNELS:
        raise LauncherError(f"unknown torch channel {choice!r}; choose one of {', '.join(CHANNEL_CHOICES)}")
    if choice not in MULTI_ARCH:
        if amd_arch != "auto":
            raise LauncherError(f"--amd-arch only applies to --torch-channel {', '.join(sorted(MULTI_ARCH))}, not {choice}")
        return CHANNELS[choice]
    target, reason = pick_target(amd_arch, windows_adapter_names())
    say(f"GPU target: {target} ({reason})")
    return replace(CHANNELS[choice], device=target)


def trio_install_args(channel: Channel) -> list[str]:
    """pip arguments that install the channel's trio (torch and torchvision with the target's kernels)."""
    extra = {"torch": f"[device-{channel.device}]", "torchvision": f"[device-{channel.device}]"} if channel.device else {}
    specs = [f"{pkg}{extra.get(pkg, '')}=={channel.versions[pkg]}" if channel.versions else pkg for pkg in TRIO]
    index = ["--index-url", channel.index_url] if channel.index_url else []
    return [*specs, *index]


def triton_install_args(channel: Channel) -> list[str]:
    """pip arguments for the channel's Triton pin (PyPI), empty where torch brings its own."""
    return [f"{pkg}=={version}" for pkg, version in channel.triton.items()]


def held_packages(channel: Channel) -> tuple[str, ...]:
    """What the constraints file holds: the trio and the channel's Triton."""
    return (*TRIO, *channel.triton)


def install_plan(channel: Channel) -> str:
    """What setup would install for `channel`, for --dry-run: the exact pins, the index, the Triton pin."""
    lines = [f"torch channel: {channel.name} ({channel.note})"]
    if channel.name == "current":
        return "\n".join([*lines, "keeps the torch trio of --python; nothing is installed"]) + "\n"
    lines.append(f"index: {channel.index_url or 'PyPI'}")
    lines.append("pip install " + " ".join(trio_install_args(channel)))
    if channel.triton:
        lines.append("pip install " + " ".join(triton_install_args(channel)) + "   (PyPI)")
    if channel.requirement_overrides:
        lines.append(requirement_overrides.plan_line(channel.requirement_overrides))
    if channel.versions:
        pins = constraints_text({**channel.versions, **channel.triton}).splitlines()[1:]
        lines.append("constraints: " + ", ".join(pins))
    else:
        lines.append("constraints: the versions pip installs")
    return "\n".join(lines) + "\n"


def installed_versions(python: Path, names: tuple[str, ...] = TRIO) -> dict[str, str]:
    """Versions of `names` importable by `python`; missing packages are left out."""
    probe = (
        "import importlib.metadata as m, json\n"
        "found = {}\n"
        f"for name in {names!r}:\n"
        "    try: found[name] = m.version(name)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(found))\n"
    )
    result = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, encoding="utf-8", errors="replace", env=clean_env())
    if result.returncode != 0:
        raise LauncherError(f"{python} could not report its packages: {result.stderr.strip()}")
    return json.loads(result.stdout)


def constraints_text(versions: dict[str, str]) -> str:
    """Pins for every later pip pass. `==X` without a local label also matches X+cu130 etc."""
    lines = [f"{pkg}=={version.split('+', 1)[0]}\n" for pkg, version in sorted(versions.items())]
    return "# written by `python -m launcher setup`: holds the torch trio (and Triton) on every pip pass\n" + "".join(lines)


NO_BYTECODE = {"PYTHONDONTWRITEBYTECODE": "1"}
"""For every Python started in the trainer checkout: no `__pycache__` is written there, so `verify`
can report any bytecode in it as foreign (Python would run it in place of the source)."""


UTF8_CHILD = {"PYTHONUTF8": "1", "PYTHONIOENCODING": "utf-8"}
"""Python's UTF-8 mode for every child: on Windows a child's pipes, files and `open()` otherwise use
the ANSI code page (cp1252), so printing a run folder named in another script kills the trainer and
a log gets bytes the launcher cannot read (ostris/ai-toolkit#865). The launcher reads children's
output as UTF-8 on every platform, because it set this."""


def clean_env() -> dict[str, str]:
    """The environment for pip and python subprocesses, without variables that redirect them.

    PYTHONPATH/PYTHONHOME, an active conda/pyenv/venv, or PIP_TARGET/PIP_PREFIX/PIP_USER
    from the user's shell would make the venv's pip install into, or import from,
    somewhere else. Index, proxy and certificate settings are kept: they are how the
    user's machine reaches a package index at all. Every child speaks UTF-8 (`UTF8_CHILD`).
    """
    blocked = {
        "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "VIRTUAL_ENV",
        "PIP_TARGET", "PIP_PREFIX", "PIP_USER", "PIP_ROOT", "PIP_CONSTRAINT",
        "PIP_REQUIRE_VIRTUALENV",
    }
    blocked_prefixes = ("CONDA_", "PYENV_VERSION")
    kept = {key: value for key, value in os.environ.items() if key not in blocked and not key.startswith(blocked_prefixes)}
    return {**kept, **UTF8_CHILD}


def default_python() -> Path:
    return Path(sys.executable)

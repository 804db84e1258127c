"""What Triton's AMD backend needs on Windows, checked before any download and handed to every trainer process.

triton-windows builds a small launcher stub (hip_utils.c) for every kernel with the clang-cl.exe of
the ROCm SDK wheel (`_rocm_sdk_core/lib/llvm/bin`). clang-cl brings no C library headers: it takes
MSVC's (vcruntime.h) and the Windows SDK's (ucrt/stdlib.h), and without them every kernel fails with
`'stdlib.h' file not found` (triton-lang/triton-windows#31; the header search is triton's
windows_utils.find_msvc_winsdk, release/3.7.x-windows). The SDK's headers and tools come from
`rocm[libraries,devel]` of the torch build's ROCm version, expanded by `rocm-sdk init`
(ROCm/TheRock docs/packaging/python_packaging.md).

The environment users found working (ROCM_HOME from `rocm-sdk path --root`, the SDK's `bin` and
`lib/llvm/bin` on PATH, CC/CXX=clang-cl, DISTUTILS_USE_SDK=1) is computed once, at setup, from the
SDK's own CLI in the trainer venv, and stored beside the venv it describes (`ENV_FILE`): it changes
only when setup rebuilds the venv, a run needs no extra process to find it, and doctor can check
that its folders still exist. PATH is composed at each launch from the stored folders and the
shell's PATH of that moment.

An integrated Radeon (most Ryzen 7000/9000 CPUs have one) can be HIP device 0; the dGPU's kernels
then fail with hipErrorInvalidImage (ROCm/TheRock#5543: masking the iGPU with HIP_VISIBLE_DEVICES
fixes it). Setup picks the discrete GPU from torch's device list (HIP's own order) unless the user
set a *_VISIBLE_DEVICES variable.

Every decision reads the host through `Host`, so tests simulate a Windows machine on any OS.
"""

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path, PureWindowsPath
from typing import Callable, Mapping

from launcher.envs.amdgpu import TARGETS
from launcher.errors import LauncherError
from launcher.user_files import load_json_state
from launcher.writer import replace_own

CHANNEL = "rocm-windows"
SDK_EXTRAS = "libraries,devel"
SDK_PACKAGES = ("rocm", "rocm-sdk-devel")  # the meta package and the headers/tools wheel, checked on the index
ENV_FILE = "rocm-windows-env.json"
USER_DEVICE_VARIABLES = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
# APU targets in LLVM's AMDGPU processor table (llvm.org/docs/AMDGPUUsage.html): Renoir/Cezanne,
# Rembrandt (680M), Raphael/Granite Ridge desktop iGPU, Phoenix (780M), Strix Point (890M),
# Strix Halo (8060S), Krackan (860M) and gfx1153.
INTEGRATED_ARCHS = frozenset({"gfx90c", "gfx1035", "gfx1036", "gfx1103", "gfx1150", "gfx1151", "gfx1152", "gfx1153"})
BUILD_TOOLS_INSTALL = (
    'winget install --id Microsoft.VisualStudio.2022.BuildTools -e --override '
    '"--wait --passive --add Microsoft.VisualStudio.Workload.VCTools --includeRecommended"'
)
VC_TOOLS_COMPONENT = "Microsoft.VisualStudio.Component.VC.Tools.x86.x64"


@dataclass(frozen=True)
class Host:
    """The facts of the machine the decisions read: injected in tests, the real ones from `this()`."""

    system: str
    environ: Mapping[str, str]
    exists: Callable[[PureWindowsPath], bool]
    listdir: Callable[[PureWindowsPath], list[str]]
    run: Callable[[list[str]], tuple[int, str]]  # (exit status, stdout)

    @classmethod
    def this(cls) -> "Host":
        import platform

        return cls(platform.system(), dict(os.environ), lambda path: Path(path).exists(), _listdir, _run)


def _listdir(path: PureWindowsPath) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _run(command: list[str]) -> tuple[int, str]:
    try:
        result = subprocess.run(command, capture_output=True, text=True, encoding="utf-8", errors="replace", timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return 1, str(error)
    return result.returncode, result.stdout


def applies(channel) -> bool:
    return channel.name == CHANNEL


# --------------------------------------------------------------------------- MSVC and Windows SDK headers


def _program_files(host: Host) -> list[PureWindowsPath]:
    names = (("ProgramFiles(x86)", r"C:\Program Files (x86)"), ("ProgramW6432", r"C:\Program Files"))
    return [PureWindowsPath(host.environ.get(key, default)) for key, default in names]


def _newest_first(versions: list[str]) -> list[str]:
    def key(text: str) -> tuple:
        parts = text.split(".")
        return tuple(int(part) for part in parts) if all(part.isdigit() for part in parts) else ()
    return sorted(versions, key=key, reverse=True)


def find_ucrt_include(host: Host) -> PureWindowsPath | None:
    """The Windows SDK's ucrt include folder holding stdlib.h (with its x64 ucrt.lib), as triton looks for it."""
    def complete(base: PureWindowsPath, version: str) -> bool:
        return (host.exists(base / "Include" / version / "ucrt" / "stdlib.h")
                and host.exists(base / "Lib" / version / "ucrt" / "x64" / "ucrt.lib"))

    sdk_dir, sdk_version = host.environ.get("WindowsSdkDir"), host.environ.get("WindowsSDKVersion")
    if sdk_dir and sdk_version and complete(PureWindowsPath(sdk_dir), sdk_version.rstrip("\\")):
        return PureWindowsPath(sdk_dir) / "Include" / sdk_version.rstrip("\\") / "ucrt"
    for program_files in _program_files(host):
        base = program_files / "Windows Kits" / "10"
        for version in _newest_first(host.listdir(base / "Include")):
            if complete(base, version):
                return base / "Include" / version / "ucrt"
    return None


def find_msvc_include(host: Host) -> PureWindowsPath | None:
    """MSVC's include folder holding vcruntime.h, from a developer prompt's variables or vswhere.exe."""
    def complete(tools: PureWindowsPath, version: str) -> bool:
        return (host.exists(tools / version / "include" / "vcruntime.h")
                and host.exists(tools / version / "lib" / "x64" / "vcruntime.lib"))

    vc_dir, vc_version = host.environ.get("VCINSTALLDIR"), host.environ.get("VCToolsVersion")
    if vc_dir and vc_version and complete(PureWindowsPath(vc_dir) / "Tools" / "MSVC", vc_version):
        return PureWindowsPath(vc_dir) / "Tools" / "MSVC" / vc_version / "include"
    vswhere = _program_files(host)[0] / "Microsoft Visual Studio" / "Installer" / "vswhere.exe"
    if not host.exists(vswhere):
        return None
    status, out = host.run([str(vswhere), "-latest", "-prerelease", "-products", "*", "-requires",
                            VC_TOOLS_COMPONENT, "-property", "installationPath"])
    for line in out.splitlines() if status == 0 else []:
        tools = PureWindowsPath(line.strip()) / "VC" / "Tools" / "MSVC"
        for version in _newest_first(host.listdir(tools)):
            if complete(tools, version):
                return tools / version / "include"
    return None


def build_tools_verdict(host: Host) -> tuple[bool, str]:
    """Whether clang-cl will find C headers here, and the one line that says so (with the fix when not)."""
    ucrt, msvc = find_ucrt_include(host), find_msvc_include(host)
    if ucrt and msvc:
        return True, f"C headers for Triton's clang-cl: MSVC {msvc}, Windows SDK {ucrt}"
    missing = " and ".join(what for what, found in (("MSVC (vcruntime.h)", msvc),
                                                    ("the Windows SDK (ucrt\\stdlib.h)", ucrt)) if not found)
    return False, (
        f"Triton's AMD backend compiles each kernel's launcher with the ROCm SDK's clang-cl, which needs the "
        f"headers of {missing}: not found (vswhere.exe, Windows Kits\\10\\Include). Install them with: "
        f"{BUILD_TOOLS_INSTALL}   then run setup again"
    )


def require_build_tools(host: Host) -> str:
    """Refuse before any download when the C headers are missing; return the verdict line otherwise."""
    ok, line = build_tools_verdict(host)
    if not ok:
        raise LauncherError(line)
    return line


# --------------------------------------------------------------------------- ROCm SDK wheels


def sdk_version(channel) -> str | None:
    """The ROCm version of the channel's torch build (`2.13.0+rocm10.0.0` -> `10.0.0`): the SDK wheels must match it."""
    if not applies(channel):
        return None
    local = channel.versions["torch"].partition("+")[2]
    if not local.startswith("rocm"):
        raise LauncherError(f"torch pin {channel.versions['torch']!r} of channel {channel.name} names no ROCm "
                            "version (+rocmX.Y.Z); fix the pin in launcher/envs/torchenv.py")
    return local.removeprefix("rocm")


def sdk_install_args(channel) -> list[str]:
    """The SDK requirement, installed in the trio's pip call so that one resolve installs all or nothing."""
    version = sdk_version(channel)
    return [f"rocm[{SDK_EXTRAS}]=={version}"] if version else []


def check_sdk_served(python: Path, channel, run: Callable[[list[str]], tuple[int, str]] = _run) -> None:
    """Before the trio's download: the index must serve the SDK wheels at the torch build's ROCm version."""
    version = sdk_version(channel)
    for package in SDK_PACKAGES if version else ():
        status, out = run([str(python), "-m", "pip", "index", "versions", package, "--index-url", channel.index_url])
        listed = next((line.split(":", 1)[1] for line in out.splitlines() if line.startswith("Available versions:")), "")
        if status != 0 or version not in [item.strip() for item in listed.split(",")]:
            raise LauncherError(
                f"{channel.index_url} serves no {package} {version} for this Python (found: {listed.strip() or 'none'}); "
                f"Triton's AMD backend needs rocm[{SDK_EXTRAS}]=={version}, the ROCm of torch {channel.versions['torch']}. "
                "Nothing was installed; try again later or use a Python version the index serves"
            )


# --------------------------------------------------------------------------- the GPU HIP should use


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    arch: str
    total_gib: float = 0.0

    @property
    def target(self) -> str:
        return self.arch.split(":", 1)[0]  # gcnArchName may carry features: gfx1100:sramecc-:xnack-

    @property
    def integrated(self) -> bool:
        return self.target in INTEGRATED_ARCHS

    def describe(self) -> str:
        kind = ", integrated" if self.integrated else ""
        return f"{self.name} ({self.target}{kind}, {self.total_gib:g} GiB)"


@dataclass(frozen=True)
class DevicePick:
    env: dict[str, str] = field(default_factory=dict)
    line: str = ""


def pick_device(gpus: list[Gpu], target: str, environ: Mapping[str, str]) -> DevicePick:
    """The discrete GPU whose kernels were installed; HIP_VISIBLE_DEVICES hides the others.
    A *_VISIBLE_DEVICES the user set is kept as it is."""
    user = [f"{name}={environ[name]}" for name in USER_DEVICE_VARIABLES if name in environ]
    if user:
        return DevicePick(line=f"GPU: {', '.join(user)} set in this shell; kept (setup picks no device)")
    if not gpus:
        return DevicePick(line="GPU: torch in the trainer venv sees no AMD GPU; update the Adrenalin driver, then "
                               "`python -m launcher doctor`")
    discrete = [gpu for gpu in gpus if not gpu.integrated]
    if not discrete:
        return DevicePick(line=f"GPU: only integrated GPUs are visible ({'; '.join(g.describe() for g in gpus)}); "
                               "training needs a discrete RX 7000/9000 card")
    matching = [gpu for gpu in discrete if gpu.target == target]
    if not matching:
        seen = discrete[0]
        fix = f"--amd-arch {seen.target}" if seen.target in TARGETS else "a card of this channel (gfx110X, gfx120X)"
        raise LauncherError(f"the kernels installed are for {target} (--amd-arch), but the GPU is {seen.describe()}: "
                            f"run setup again with {fix}")
    best = max(matching, key=lambda gpu: gpu.total_gib)
    if len(gpus) == 1:
        return DevicePick(line=f"GPU: {best.describe()}, the only one HIP sees")
    hidden = "; ".join(gpu.describe() for gpu in gpus if gpu is not best)
    return DevicePick({"HIP_VISIBLE_DEVICES": str(best.index)},
                      f"GPU: {best.describe()} is HIP device {best.index}; HIP_VISIBLE_DEVICES={best.index} hides {hidden}")


# --------------------------------------------------------------------------- the trainer's environment


def toolchain_variables(root: PureWindowsPath, core: PureWindowsPath, venv_scripts: PureWindowsPath,
                        exists: Callable[[PureWindowsPath], bool]) -> dict:
    """The stored environment: variables, and the folders PATH gets in front (the venv's Scripts first,
    where triton's driver finds the `rocm-sdk` CLI). clang-cl is named by full path."""
    llvm_bins = [folder / "lib" / "llvm" / "bin" for folder in (root, core)]
    llvm_bin = next((folder for folder in llvm_bins if exists(folder / "clang-cl.exe")), None)
    if llvm_bin is None:
        raise LauncherError(f"the ROCm SDK has no clang-cl.exe (looked in {llvm_bins[0]} and {llvm_bins[1]}); "
                            "`rocm-sdk init` did not expand the devel wheel: remove the venv folder and run setup again")
    clang_cl = str(llvm_bin / "clang-cl.exe")
    return {
        "variables": {"ROCM_HOME": str(root), "HIP_PATH": str(root), "CC": clang_cl, "CXX": clang_cl,
                      "DISTUTILS_USE_SDK": "1"},
        "path_prepend": [str(venv_scripts), str(root / "bin"), str(llvm_bin)],
    }


def compose_env(stored: dict, environ: Mapping[str, str]) -> dict[str, str]:
    """What a trainer process gets from the stored toolchain: the variables, PATH with the stored
    folders first, and the device pick unless the user set a *_VISIBLE_DEVICES of their own."""
    if not stored:
        return {}
    variables = dict(stored.get("variables", {}))
    if any(name in environ for name in USER_DEVICE_VARIABLES):
        variables.pop("HIP_VISIBLE_DEVICES", None)
    path = os.pathsep.join([*stored.get("path_prepend", []), environ.get("PATH", "")]).rstrip(os.pathsep)
    return {**variables, "PATH": path}


def stored_env(venv: Path) -> dict:
    """The toolchain setup stored for this venv; {} for other channels or a damaged file."""
    return load_json_state(venv / ENV_FILE)


def trainer_env(venv: Path, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The toolchain part of a trainer process's environment (run, selftest, sample, probes)."""
    return compose_env(stored_env(venv), os.environ if environ is None else environ)


def write_stored_env(venv: Path, stored: dict) -> None:
    replace_own(venv / ENV_FILE, json.dumps(stored, indent=2) + "\n")


# --------------------------------------------------------------------------- what doctor checks


def startup_triton_imports(venv: Path) -> list[str]:
    """Files Python runs at every start in this venv (.pth lines, sitecustomize) that import triton:
    triton would then load before torch in every trainer process."""
    found = []
    for site in [*venv.glob("Lib/site-packages"), *venv.glob("lib/python*/site-packages")]:
        for path in [*site.glob("*.pth"), site / "sitecustomize.py", site / "usercustomize.py"]:
            try:
                text = path.read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue
            if any("triton" in line and "import" in line for line in text.splitlines()):
                found.append(str(path))
    return found


def doctor_facts(venv: Path, host: Host) -> dict:
    """What doctor reports about the Windows ROCm toolchain of `venv`."""
    stored = stored_env(venv)
    variables = stored.get("variables", {})
    folders = [variables.get("ROCM_HOME"), variables.get("CC"), *stored.get("path_prepend", [])]
    return {
        "build_tools": list(build_tools_verdict(host)),
        "stored_env": bool(stored),
        "missing_folders": [folder for folder in folders if folder and not host.exists(PureWindowsPath(folder))],
        "startup_triton": startup_triton_imports(venv),
        "user_devices": {name: host.environ[name] for name in USER_DEVICE_VARIABLES if name in host.environ},
    }

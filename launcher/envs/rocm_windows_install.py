"""Setup's Windows ROCm steps around the pip installs: the plan, the checks before any download, and
after the install `rocm-sdk init`, the trainer's toolchain environment, the GPU pick and one Triton
kernel compiled in the trainer venv. The decisions themselves live in `rocm_windows_toolchain`."""

import json
import subprocess
from pathlib import Path, PureWindowsPath

from launcher.envs import rocm_windows_toolchain as toolchain
from launcher.envs.amdgpu import windows_adapter_names
from launcher.envs.trainer_python import run_module
from launcher.envs.torchenv import clean_env
from launcher.errors import LauncherError
from launcher.progress import say, step

SDK_PATHS_PROBE = (
    "import json, pathlib, subprocess, sys\n"
    "import _rocm_sdk_core\n"
    "def ask(flag):\n"
    "    return subprocess.run([sys.executable, '-m', 'rocm_sdk', 'path', flag], capture_output=True, text=True,"
    " check=True).stdout.strip()\n"
    "print(json.dumps({'root': ask('--root'), 'core': str(pathlib.Path(_rocm_sdk_core.__file__).parent),"
    " 'scripts': str(pathlib.Path(sys.executable).parent)}))\n"
)


def plan_lines(channel, host: toolchain.Host) -> list[str]:
    """What setup will do beyond the torch pins, for --dry-run: SDK wheels, init, toolchain verdict, GPU pick."""
    if not toolchain.applies(channel):
        return []
    _, verdict = toolchain.build_tools_verdict(host)
    names = windows_adapter_names() if host.system == "Windows" else []
    return [
        f"ROCm SDK for Triton: pip install {' '.join(toolchain.sdk_install_args(channel))} (same index, in the trio's "
        f"pip call; {', '.join(toolchain.SDK_PACKAGES)} {toolchain.sdk_version(channel)} checked on the index first)",
        "then: python -m rocm_sdk init, and the trainer's environment from `rocm-sdk path --root`: ROCM_HOME, "
        "HIP_PATH, CC/CXX=clang-cl, DISTUTILS_USE_SDK=1, PATH += venv Scripts, SDK bin, lib\\llvm\\bin "
        f"(stored in <venv>/{toolchain.ENV_FILE})",
        ("toolchain: " if host.system == "Windows" else "toolchain (checked on Windows only): ") + verdict,
        "GPU pick: after the install, from torch's device list in the venv (HIP's order): the discrete "
        f"{channel.device} card, others hidden with HIP_VISIBLE_DEVICES; display adapters now: "
        + (", ".join(names) or "none read"),
        "then: one Triton kernel compiled and run in the venv (setup says in one line why, if it fails)",
    ]


def check_before_download(python: Path, channel) -> None:
    """Refuse before the trio's download when the index lacks the SDK wheels of the torch build's ROCm."""
    if toolchain.applies(channel):
        with step(f"checking {channel.index_url} for rocm[{toolchain.SDK_EXTRAS}]=={toolchain.sdk_version(channel)}"):
            toolchain.check_sdk_served(python, channel)


def finish_install(venv: Path, python: Path, channel, host: toolchain.Host | None = None) -> None:
    """After pip: init the SDK, compute the trainer's environment, pick the GPU, compile one kernel,
    then store the environment. Any failure before the store leaves no environment file (and
    install writes no marker), so the next setup does it all again."""
    target = venv / toolchain.ENV_FILE
    if not toolchain.applies(channel):
        target.unlink(missing_ok=True)
        return
    with step("expanding the ROCm SDK (python -m rocm_sdk init)"):
        _checked([str(python), "-m", "rocm_sdk", "init", "--quiet"], "rocm-sdk init")
    host = host or toolchain.Host.this()
    paths = json.loads(_checked([str(python), "-c", SDK_PATHS_PROBE], "rocm-sdk path --root"))
    stored = toolchain.toolchain_variables(PureWindowsPath(paths["root"]), PureWindowsPath(paths["core"]),
                                           PureWindowsPath(paths["scripts"]), host.exists)
    environ = host.environ
    env = toolchain.compose_env(stored, environ)
    listed = _probe(python, "devices", env)
    if "error" in listed:
        pick = toolchain.DevicePick(line=f"GPU: torch's device list failed in the trainer venv ({listed['error']}); "
                                         "no device picked")
    else:
        pick = toolchain.pick_device([toolchain.Gpu(**gpu) for gpu in listed["gpus"]], channel.device, environ)
    say(pick.line)
    stored["variables"].update(pick.env)
    _report_compile(python, {**env, **pick.env})
    toolchain.write_stored_env(venv, stored)
    say(f"the trainer's ROCm toolchain environment: {target}")


def _report_compile(python: Path, env: dict[str, str]) -> None:
    """Compile one trivial kernel; say in one line why not, since training still runs without Triton (slower)."""
    with step("compiling one Triton kernel in the trainer venv"):
        result = _probe(python, "compile", env)
    if "error" in result:
        say(f"Triton cannot compile here ({result['error']}); no torch.compile or Triton int4 kernels: selftest "
            "keeps qtype auto on uint4, blocks uncompiled (slower). `python -m launcher doctor` names the fix")
    else:
        say(f"Triton {result['triton']} compiled and ran a kernel on {result['device']}")


def _probe(python: Path, mode: str, env: dict[str, str]) -> dict:
    try:
        result = run_module(python, "rocm_windows_probe", mode, capture=True, timeout=600, env=env)
    except (OSError, subprocess.TimeoutExpired) as error:
        return {"error": f"the probe could not run: {error}"}
    if result.returncode != 0:
        lines = [line.strip() for line in result.stderr.splitlines() + result.stdout.splitlines() if line.strip()]
        return {"error": _first_cause(lines)}
    return json.loads(result.stdout)


def _first_cause(lines: list[str]) -> str:
    """The compiler's own error when there is one (`fatal error: 'stdlib.h' file not found`), else the last line."""
    fatal = [line for line in lines if "fatal error" in line]
    return (fatal or lines or ["no output"])[0 if fatal else -1][:300]


def _checked(command: list[str], what: str) -> str:
    result = subprocess.run(command, capture_output=True, text=True, encoding="utf-8", errors="replace", env=clean_env())
    if result.returncode != 0:
        reason = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise LauncherError(f"{what} failed in the trainer venv ({reason}); the venv is not marked installed: "
                            "run setup again, or remove the venv folder if it fails twice")
    return result.stdout

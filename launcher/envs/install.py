"""The trainer's own Python environment: a venv with the torch trio and the fork's requirements."""

import hashlib
import json
import subprocess
from pathlib import Path

from launcher.envs import requirement_overrides, rocm_windows_install
from launcher.envs.rocm_windows_toolchain import sdk_install_args
from launcher.envs.torchenv import (
    TRIO,
    Channel,
    clean_env,
    constraints_text,
    held_packages,
    installed_versions,
    trio_install_args,
    triton_install_args,
)
from launcher.envs.workdir import Workdir, venv_python
from launcher.errors import LauncherError
from launcher.progress import say, step
from launcher.user_files import load_json_state
from launcher.writer import replace_own

MARKER = "launcher-install.json"


def install_spec(channel: Channel, requirements: Path) -> dict:
    """What an install depends on; a venv built from another spec is rebuilt by pip, not reused."""
    digest = hashlib.sha256()
    for path in requirement_files(requirements):
        digest.update(path.read_bytes())
    return {
        "channel": channel.name,
        "versions": channel.versions,
        "index_url": channel.index_url,
        "device": channel.device,
        "triton": channel.triton,
        "requirements_sha256": digest.hexdigest(),
        # only where a channel has overrides, so the markers of the venvs of other channels stay valid
        **({"requirement_overrides": channel.requirement_overrides} if channel.requirement_overrides else {}),
    }


def requirement_files(requirements: Path) -> list[Path]:
    """The requirements file and every file it includes with `-r` (upstream splits them)."""
    found = [requirements]
    for line in requirements.read_text(encoding="utf-8").splitlines():
        parts = line.split("#", 1)[0].split()
        if len(parts) == 2 and parts[0] in ("-r", "--requirement"):
            included = requirements.parent / parts[1]
            if included.is_file() and included not in found:
                found += requirement_files(included)
    return found


def is_current(workdir: Workdir, spec: dict) -> bool:
    return load_json_state(workdir.venv / MARKER) == spec


def install(workdir: Workdir, channel: Channel, base_python: Path, requirements_name: str) -> None:
    """Create the venv if needed, install the trio, pin it, install the fork's requirements."""
    requirements = workdir.trainer / requirements_name
    if not requirements.is_file():
        raise LauncherError(f"{requirements} is missing; the target's `requirements` in upstream.lock is wrong")
    spec = install_spec(channel, requirements)
    if is_current(workdir, spec):
        say(f"trainer environment {workdir.venv} is up to date ({channel.name})")
        return
    python = venv_python(workdir.venv)
    if not python.exists():
        with step(f"creating the trainer environment {workdir.venv}"):
            args = [str(base_python), "-m", "venv", str(workdir.venv)]
            if channel.name == "current":
                args.insert(3, "--system-site-packages")
            _run(args, "creating the venv")
    if channel.name == "current":
        versions = installed_versions(python)
        missing = [pkg for pkg in TRIO if pkg not in versions]
        if missing:
            raise LauncherError(
                f"--torch-channel current keeps the torch of {base_python}, but it lacks "
                f"{', '.join(missing)}; install them there or pick another channel"
            )
    else:
        rocm_windows_install.check_before_download(python, channel)
        with step(f"installing torch, torchvision, torchaudio ({channel.name}: {channel.note})"):
            _pip(python, ["install", *trio_install_args(channel), *sdk_install_args(channel)], unserved=channel)
        if channel.triton:
            with step(f"installing {', '.join(triton_install_args(channel))}"):
                _pip(python, ["install", *triton_install_args(channel)])
            _check_triton_amd(python, channel)
        versions = installed_versions(python, held_packages(channel))
    constraints = workdir.root / "constraints.txt"
    replace_own(constraints, constraints_text(versions))
    say(f"holding {', '.join(f'{k} {v}' for k, v in sorted(versions.items()))} with {constraints}")
    if channel.requirement_overrides:
        requirements = requirement_overrides.write_adjusted(
            requirements, channel.requirement_overrides, workdir.root / f"requirements-{channel.name}.txt")
        say(f"{requirements}: the trainer's requirements with {channel.name}'s overrides "
            + ", ".join(f"{k}=={v}" for k, v in sorted(channel.requirement_overrides.items())))
    with step(f"installing the trainer's requirements from {requirements}"):
        _pip(python, ["install", "-r", str(requirements), "-c", str(constraints)])
    after = installed_versions(python, tuple(versions))
    if after != versions:
        raise LauncherError(f"pip changed the held packages from {versions} to {after}; report this with the log")
    rocm_windows_install.finish_install(workdir.venv, python, channel)
    replace_own(workdir.venv / MARKER, json.dumps(spec, indent=2) + "\n")


TRITON_AMD_PROBE = (
    "import torch  # first: TheRock's ROCm fails when triton loads before torch (triton-windows#35)\n"
    "from triton.backends import backends\n"
    "assert 'amd' in backends, f'no amd backend among {sorted(backends)}'\n"
    "assert backends['amd'].driver.is_active(), 'the amd driver is not active (torch.version.hip unset)'\n"
)


def _check_triton_amd(python: Path, channel: Channel) -> None:
    """Say in one line when the pinned Triton's AMD backend does not load: the self-test then picks the slower paths."""
    if not channel.device:
        return
    result = subprocess.run([str(python), "-c", TRITON_AMD_PROBE], capture_output=True, text=True, encoding="utf-8", errors="replace",
                            env=clean_env())
    if result.returncode != 0:
        reason = (result.stderr.strip().splitlines() or ["no output"])[-1]
        say(f"{' '.join(triton_install_args(channel))}: the AMD backend does not load ({reason}); "
            "no torch.compile or Triton int4 kernels: selftest keeps qtype auto on uint4, blocks uncompiled (slower)")


def _pip(python: Path, args: list[str], unserved: Channel | None = None) -> None:
    """Run pip; with `unserved`, a failure is reported as the channel's index not serving its pins."""
    command = [str(python), "-m", "pip", *args, "--progress-bar", "on"]
    if unserved is None:
        _run(command, f"pip {args[0]}")
        return
    result = subprocess.run(command, env=clean_env())
    if result.returncode != 0:
        raise LauncherError(
            f"could not install {' '.join(trio_install_args(unserved)[:3])} from {unserved.index_url or 'PyPI'} "
            f"(pip exit {result.returncode}, output above: the index no longer serves them for this Python, or is "
            "unreachable); nothing was removed. The slower route: --torch-channel cpu (no GPU), or "
            "--torch-channel current with a torch you installed into --python"
        )


def _run(args: list[str], what: str) -> None:
    """Run a tool with its output streaming to the console, so long installs show progress."""
    result = subprocess.run(args, env=clean_env())
    if result.returncode != 0:
        raise LauncherError(
            f"{what} failed (exit {result.returncode}): {' '.join(args)}\n"
            "The output above says why; nothing was removed, run setup again once fixed."
        )

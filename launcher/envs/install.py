"""The trainer's own Python environment: a venv with the torch trio and the fork's requirements."""

import hashlib
import json
import subprocess
from pathlib import Path

from launcher.atomic import write_text_atomic
from launcher.envs.torchenv import (
    Channel,
    clean_env,
    constraints_text,
    installed_trio,
    trio_install_args,
)
from launcher.envs.workdir import Workdir, venv_python
from launcher.errors import LauncherError
from launcher.progress import say, step

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
        "requirements_sha256": digest.hexdigest(),
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
    marker = workdir.venv / MARKER
    try:
        return json.loads(marker.read_text(encoding="utf-8")) == spec
    except (FileNotFoundError, json.JSONDecodeError):
        return False


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
        versions = installed_trio(python)
        missing = [pkg for pkg in ("torch", "torchvision", "torchaudio") if pkg not in versions]
        if missing:
            raise LauncherError(
                f"--torch-channel current keeps the torch of {base_python}, but it lacks "
                f"{', '.join(missing)}; install them there or pick another channel"
            )
    else:
        with step(f"installing torch, torchvision, torchaudio ({channel.name}: {channel.note})"):
            _pip(python, ["install", *trio_install_args(channel)])
        versions = installed_trio(python)
    constraints = workdir.root / "constraints.txt"
    write_text_atomic(constraints, constraints_text(versions))
    say(f"holding {', '.join(f'{k} {v}' for k, v in sorted(versions.items()))} with {constraints}")
    with step(f"installing the trainer's requirements from {requirements}"):
        _pip(python, ["install", "-r", str(requirements), "-c", str(constraints)])
    after = installed_trio(python)
    if after != versions:
        raise LauncherError(f"pip changed the torch trio from {versions} to {after}; report this with the log")
    write_text_atomic(workdir.venv / MARKER, json.dumps(spec, indent=2) + "\n")


def _pip(python: Path, args: list[str]) -> None:
    _run([str(python), "-m", "pip", *args, "--progress-bar", "on"], f"pip {args[0]}")


def _run(args: list[str], what: str) -> None:
    """Run a tool with its output streaming to the console, so long installs show progress."""
    result = subprocess.run(args, env=clean_env())
    if result.returncode != 0:
        raise LauncherError(
            f"{what} failed (exit {result.returncode}): {' '.join(args)}\n"
            "The output above says why; nothing was removed, run setup again once fixed."
        )

"""Run one of the launcher's `launcher.in_trainer` modules under the trainer venv's interpreter.

torch, matplotlib and the trainer's own classes live in the trainer's venv, not in the
launcher's. Every call goes through here so that each child gets the same environment:
the user's shell scrubbed of variables that redirect Python (`clean_env`), plus the folder
that holds the `launcher` package on PYTHONPATH, so the venv imports this launcher without
installing it.
"""

import subprocess
from pathlib import Path

from launcher.envs.rocm_windows_toolchain import trainer_env as toolchain_env
from launcher.envs.torchenv import NO_BYTECODE, clean_env

LAUNCHER_ROOT = Path(__file__).resolve().parents[2]
"""The folder holding the `launcher` package."""


def module_command(python: Path, module: str, *args: str) -> list[str]:
    """`python -m launcher.in_trainer.<module> ARGS` (`module` may be dotted: `selftest.runner`);
    paths in ARGS should be absolute."""
    return [str(python), "-m", f"launcher.in_trainer.{module}", *args]


def child_env(extra: dict[str, str] | None = None, python: Path | None = None) -> dict[str, str]:
    """`python`'s venv adds the ROCm toolchain setup stored there (Windows ROCm; nothing elsewhere)."""
    toolchain = toolchain_env(python.parent.parent) if python else {}
    return {**clean_env(), **toolchain, **(extra or {}), "PYTHONPATH": str(LAUNCHER_ROOT), **NO_BYTECODE}


def run_module(python: Path, module: str, *args: str, capture: bool = False,
               timeout: float | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run an in-trainer module to completion; its output is captured as text when asked (UTF-8, as
    `clean_env` tells the child to write); `env` adds variables."""
    text = {"encoding": "utf-8", "errors": "replace"} if capture else {}
    return subprocess.run(module_command(python, module, *args), cwd=LAUNCHER_ROOT, env=child_env(env, python),
                          capture_output=capture, timeout=timeout, **text)


def start_module(python: Path, module: str, *args: str, env: dict[str, str] | None = None,
                 **popen_kwargs) -> subprocess.Popen:
    """Start an in-trainer module and return at once (the watchdog's bursts); `env` adds variables."""
    return subprocess.Popen(module_command(python, module, *args), cwd=LAUNCHER_ROOT, env=child_env(env, python),
                            **popen_kwargs)

"""Runs the in-trainer suite (tests/trainer_patches) with the trainer venv's own interpreter.

Those tests import torch and the patched trainer's modules, which live in the trainer's venv,
not in the launcher's; this bridge makes them part of the one README test command.
"""

import os
import subprocess
import sys

from conftest import REPO_ROOT

from launcher.envs.torchenv import clean_env
from launcher.envs.workdir import venv_python

SUITE = REPO_ROOT / "tests" / "trainer_patches"


def ensure_test_tools(python, constraints) -> None:
    """pytest and hypothesis in the trainer venv, with the torch trio held."""
    if subprocess.run([str(python), "-c", "import pytest, hypothesis"], capture_output=True).returncode == 0:
        return
    pins = ["-c", str(constraints)] if constraints.is_file() else []
    subprocess.run([str(python), "-m", "pip", "install", "-q", "pytest", "hypothesis", *pins], check=True, env=clean_env())


def test_in_trainer_suite_passes(trainer_workdir):
    python = venv_python(trainer_workdir.venv)
    ensure_test_tools(python, trainer_workdir.root / "constraints.txt")
    env = {**clean_env(), "LAUNCHER_TEST_WORKDIR": str(trainer_workdir.root), "PYTHONPATH": str(REPO_ROOT),
           "LAUNCHER_PYTHON": sys.executable,
           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
    result = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(SUITE / "pytest.ini"),
         "--confcutdir", str(SUITE), str(SUITE)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True,
    )
    print(result.stdout[-20000:], result.stderr[-5000:])
    assert result.returncode == 0, "the in-trainer suite failed; its report is above"
    assert " passed" in result.stdout and " skipped" not in result.stdout.splitlines()[-1], result.stdout.splitlines()[-1]

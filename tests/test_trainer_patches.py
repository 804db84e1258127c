"""Runs the in-trainer suite (tests/trainer_patches) with each target's trainer venv interpreter.

Those tests import torch and the patched trainer's modules, which live in the trainer's venv,
not in the launcher's; this bridge makes them part of the one README test command, once per
target of upstream.lock. A test for a patch that a target's series does not carry (marker
`patch`), or that reads torchao's uint4 layout on a target whose uint4 is OstrisLinear (marker
`torchao_uint4`), is deselected there; tests marked `gpu` are deselected where the trainer's
torch sees no GPU. Anything else that skips fails the bridge.
"""

import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

from launcher.envs.torchenv import clean_env
from launcher.envs.workdir import venv_python

pytestmark = pytest.mark.trainer

SUITE = REPO_ROOT / "tests" / "trainer_patches"


def ensure_test_tools(python, constraints) -> None:
    """pytest and hypothesis in the trainer venv, with the torch trio held."""
    if subprocess.run([str(python), "-c", "import pytest, hypothesis"], capture_output=True).returncode == 0:
        return
    pins = ["-c", str(constraints)] if constraints.is_file() else []
    subprocess.run([str(python), "-m", "pip", "install", "-q", "pytest", "hypothesis", *pins], check=True, env=clean_env())


def sees_a_gpu(python, env) -> bool:
    probe = subprocess.run([str(python), "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True, env=env)
    return probe.stdout.strip().splitlines()[-1:] == ["True"]


def test_in_trainer_suite_passes(target_workdir):
    workdir = target_workdir.workdir
    python = venv_python(workdir.venv)
    ensure_test_tools(python, workdir.root / "constraints.txt")
    env = {**clean_env(), "LAUNCHER_TEST_WORKDIR": str(workdir.root), "PYTHONPATH": str(REPO_ROOT),
           "LAUNCHER_TEST_SERIES": str(target_workdir.target.series), "LAUNCHER_PYTHON": sys.executable,
           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
    select = [] if sees_a_gpu(python, env) else ["-m", "not gpu"]
    result = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(SUITE / "pytest.ini"),
         "--confcutdir", str(SUITE), *select, str(SUITE)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True,
    )
    print(result.stdout[-20000:], result.stderr[-5000:])
    assert result.returncode == 0, f"the in-trainer suite failed on {target_workdir.target.name}; its report is above"
    summary = result.stdout.splitlines()[-1]
    assert " passed" in summary and " skipped" not in summary, summary

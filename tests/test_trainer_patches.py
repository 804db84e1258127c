"""Runs the in-trainer suite (tests/trainer_patches) with each target's trainer venv interpreter.

Those tests import torch and the patched trainer's modules, which live in the trainer's venv,
not in the launcher's; this bridge makes them part of the one README test command, once per
target of upstream.lock. A test for a patch that a target's series does not carry (marker
`patch`), or that reads torchao's uint4 layout on a target whose uint4 is OstrisLinear (marker
`torchao_uint4`), is deselected there; tests marked `gpu` are deselected where the trainer's
torch sees no GPU. Anything else that skips fails the bridge.

The targets' suites run at the same time, one process each (the first test starts them all and
each test waits for its own): a suite is one Python process that keeps at most one core busy
(amd-fork's alone on 2 shared cores: 1125 s wall, 810 s of CPU), so
on CI's 2 cores the two finish in about the time of the longer one instead of the sum. Measured
in clean-clone CI runs on 2 shared cores: one after the other 647 s (amd-fork) + 578 s
(upstream-main); at the same time 571 s for the first test, then 42 s for the second. Each suite
has its own workdir and its own pytest base temp folder; no test of the suite asserts a time,
and the host-RSS peaks it compares are each of one child process, which another process beside
it does not change.
"""

import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, TARGETS

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


def start_suite(target, workdir, scratch):
    """Start the in-trainer suite for one target; returns (process, its stdout file, its stderr file)."""
    python = venv_python(workdir.venv)
    ensure_test_tools(python, workdir.root / "constraints.txt")
    env = {**clean_env(), "LAUNCHER_TEST_WORKDIR": str(workdir.root), "PYTHONPATH": str(REPO_ROOT),
           "LAUNCHER_TEST_SERIES": str(target.series), "LAUNCHER_PYTHON": sys.executable,
           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
    select = [] if sees_a_gpu(python, env) else ["-m", "not gpu"]
    stdout, stderr = scratch / f"{target.name}.out", scratch / f"{target.name}.err"
    with stdout.open("wb") as out, stderr.open("wb") as err:
        process = subprocess.Popen(
            [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(SUITE / "pytest.ini"),
             "--confcutdir", str(SUITE), "--basetemp", str(scratch / target.name), *select, str(SUITE)],
            cwd=REPO_ROOT, env=env, stdout=out, stderr=err,
        )
    return process, stdout, stderr


@pytest.fixture(scope="module")
def in_trainer_suites(installed_workdirs, tmp_path_factory):
    """Every target's suite, started together: {target name: (process, stdout, stderr) or the outcome
    (fail/skip) of getting its workdir, which only that target's test re-raises}."""
    scratch = tmp_path_factory.mktemp("in-trainer")
    started = {}
    for target in TARGETS:
        try:
            started[target.name] = start_suite(target, installed_workdirs(target.name), scratch)
        except (pytest.fail.Exception, pytest.skip.Exception) as outcome:
            started[target.name] = outcome
    yield started
    for entry in started.values():
        if isinstance(entry, tuple) and entry[0].poll() is None:
            entry[0].kill()
            entry[0].wait()


@pytest.mark.parametrize("target", TARGETS, ids=[t.name for t in TARGETS])
def test_in_trainer_suite_passes(in_trainer_suites, target):
    entry = in_trainer_suites[target.name]
    if isinstance(entry, BaseException):
        raise entry
    process, stdout, stderr = entry
    returncode = process.wait()
    output = stdout.read_text(encoding="utf-8", errors="replace")
    print(output[-20000:], stderr.read_text(encoding="utf-8", errors="replace")[-5000:])
    assert returncode == 0, f"the in-trainer suite failed on {target.name}; its report is above"
    summary = output.splitlines()[-1]
    assert " passed" in summary and " skipped" not in summary, summary

"""Each target's in-trainer suite (tests/trainer_patches), run in the background by the target's
trainer venv interpreter from the moment its workdir exists.

Those tests import torch and the patched trainer's modules, which live in the trainer's venv,
not in the launcher's; tests/test_trainer_patches.py makes them part of the one README test
command and waits for each target's result. A suite is one Python process that keeps at most
one core busy (amd-fork's alone on 2 shared cores: 1125 s wall, 810 s of CPU), so it is started
as soon as InstalledWorkdirs has the workdir, and runs beside the launcher's own trainer tests
instead of after them: on CI's 2 cores the suites' ~20 CPU-minutes fill the gaps those tests
leave. No test of a suite asserts a time, and the host-RSS peaks it compares are each of one
child process, which other processes beside it do not change; the launcher tests beside them
put no upper bound on a duration (a loaded machine only makes them slower). Measured in a
clean-clone CI run on 2 idle cores: the suites took 1056 s and 1129 s beside the launcher's
tests (about 600 s each without them), and the whole run 24 min 10 s, against 25 min 43 s with
the suites after those tests; another run of the same layout took 26 min 13 s (the run is bound
by its CPU time now, which varies by a few minutes).
"""

import os
import subprocess
import sys
from pathlib import Path

from launcher.envs.torchenv import clean_env
from launcher.envs.workdir import Workdir, venv_python

SUITE = Path(__file__).resolve().parent / "trainer_patches"
REPO_ROOT = SUITE.parent.parent


def ensure_test_tools(python: Path, constraints: Path) -> None:
    """pytest and hypothesis in the trainer venv, with the torch trio held."""
    if subprocess.run([str(python), "-c", "import pytest, hypothesis"], capture_output=True).returncode == 0:
        return
    pins = ["-c", str(constraints)] if constraints.is_file() else []
    subprocess.run([str(python), "-m", "pip", "install", "-q", "pytest", "hypothesis", *pins], check=True, env=clean_env())


def sees_a_gpu(python: Path, env: dict) -> bool:
    probe = subprocess.run([str(python), "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True, env=env)
    return probe.stdout.strip().splitlines()[-1:] == ["True"]


class Suite:
    """One target's running (or finished) suite: its process and the files it writes its report to.

    `name`, `tests` and `env` make it another suite on the target's checkout: the user stack's
    (tests/user_stack.py) runs a part of the tests (`tests`: pytest arguments) with its pins in `env`.
    """

    def __init__(self, target, workdir: Workdir, scratch: Path, name: str | None = None,
                 tests: tuple[str, ...] = (str(SUITE),), env: dict | None = None) -> None:
        python = venv_python(workdir.venv)
        ensure_test_tools(python, workdir.root / "constraints.txt")
        env = {**clean_env(), "LAUNCHER_TEST_WORKDIR": str(workdir.root), "PYTHONPATH": str(REPO_ROOT),
               "LAUNCHER_TEST_SERIES": str(target.series), "LAUNCHER_PYTHON": sys.executable,
               "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", ""), **(env or {})}
        select = [] if sees_a_gpu(python, env) else ["-m", "not gpu"]
        name = name or target.name
        self.stdout, self.stderr = scratch / f"{name}.out", scratch / f"{name}.err"
        with self.stdout.open("wb") as out, self.stderr.open("wb") as err:
            self.process = subprocess.Popen(
                [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(SUITE / "pytest.ini"),
                 "--confcutdir", str(SUITE), "--basetemp", str(scratch / name), *select, *tests],
                cwd=REPO_ROOT, env=env, stdout=out, stderr=err,
            )

    def wait(self) -> tuple[int, str, str]:
        """(return code, stdout, stderr) once the suite has finished."""
        returncode = self.process.wait()
        return (returncode, self.stdout.read_text(encoding="utf-8", errors="replace"),
                self.stderr.read_text(encoding="utf-8", errors="replace"))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


class BackgroundSuites:
    """The suites of one test run, keyed by target name; each is started once."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.suites: dict[str, Suite] = {}

    def start(self, target, workdir: Workdir) -> Suite:
        if target.name not in self.suites:
            self.suites[target.name] = Suite(target, workdir, self.scratch)
        return self.suites[target.name]

    def stop(self) -> None:
        for suite in self.suites.values():
            suite.stop()

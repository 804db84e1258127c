"""The rocm-windows channel's versions, built on Linux: CI's "user stack" trainer venv.

AMD's Windows wheels cannot run here, so CI builds their Linux twin through the launcher's own
code: `setup --no-install` for the patched checkout, then launcher.envs.install.install with
LINUX_TWIN, a copy of CHANNELS["rocm-windows"] with the same requirement overrides, torch
2.13.0 and torchvision 0.28.0 from PyPI, and PyPI's triton 3.7.1 (the Triton that
triton-windows 3.7.1 is built from, with the same AMD backend). The requirements pass then
resolves the fork's requirements against those pins as setup does on Windows.

UserStackBuild is the test run's: it builds the venv in a child process beside the targets' setups
and starts the focused in-trainer suite (SUITE_TESTS) the moment the venv exists, as
tests/in_trainer_suites.py does for each target; tests/test_user_stack.py reads both.
"""

import json
import os
import subprocess
import sys
import tempfile
import threading
from dataclasses import replace
from pathlib import Path

from launcher.envs.torchenv import CHANNELS
from launcher.envs.workdir import Workdir

WINDOWS = CHANNELS["rocm-windows"]
LINUX_TWIN = replace(
    WINDOWS,
    name="rocm-windows-linux-twin",
    # PyPI's torchaudio 2.11.0 pins no torch and links torch's stable ABI (AMD ships 2.11.0.2 with 2.13)
    versions={"torch": "2.13.0", "torchvision": "0.28.0", "torchaudio": "2.11.0"},
    index_url=None,
    note="rocm-windows's versions on Linux, for CI",
    triton={"triton": "3.7.1"},
    device=None,
)
USER_STACK_PINS = {
    "torch": WINDOWS.versions["torch"].split("+", 1)[0],
    "torchvision": WINDOWS.versions["torchvision"].split("+", 1)[0],
    "triton": WINDOWS.triton["triton-windows"].split(".post", 1)[0],
    **WINDOWS.requirement_overrides,
}
"""What the user-stack venv must hold: the Windows channel's versions without their build labels."""

REPO = Path(__file__).resolve().parent.parent
LOG_NAME = "user-stack.setup.log"


def build(workdir: Path) -> None:
    """The checkout, then the twin channel's install, in this process (tests start it as a child).

    PyPI's torchvision 0.28.0 and torchaudio 2.11.0 link the libraries of PyPI's torch 2.13.0
    (libtorch_cuda, libc10_cuda), so that build is the one installed: pip's find-links (PIP_FIND_LINKS
    or pip.conf) may offer a local CPU build of torch, which `torch==2.13.0` would take (its
    `+cpu` label sorts higher) and next to which neither package imports; find-links is pointed
    at an empty folder for this install. docs/testing.md, "The user stack", has the measurements.
    """
    from launcher.cli import main
    from launcher.envs.install import install
    from launcher.envs.workdir import Workdir
    from launcher.patching.lock import DEFAULT_LOCK, load_targets

    if main(["setup", "--workdir", str(workdir), "--no-install"]) != 0:
        raise SystemExit(f"the checkout in {workdir} failed")
    with tempfile.TemporaryDirectory() as no_local_wheels:
        os.environ["PIP_FIND_LINKS"] = no_local_wheels
        install(Workdir(workdir), LINUX_TWIN, Path(sys.executable), load_targets(DEFAULT_LOCK)[0].requirements)


def start(workdir: Path) -> tuple[subprocess.Popen, Path]:
    """Build the user stack in `workdir` in a child process; (process, its log)."""
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir.with_name(workdir.name + "." + LOG_NAME)
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(workdir)], cwd=REPO,
                                   stdout=out, stderr=subprocess.STDOUT)
    return process, log


VARIABLE = "LAUNCHER_TEST_WORKDIR_USER_STACK"
"""Names an existing user-stack workdir to reuse (for development), as LAUNCHER_TEST_WORKDIR does."""
COMPILE_TESTS = ("test_compiled_blocks_match_the_uncompiled_ones", "test_one_compiled_forward_serves_every_block_of_a_class",
                 "test_a_4bit_block_compiles_whole_around_its_4bit_matmuls",
                 "test_a_block_class_that_cannot_compile_runs_uncompiled_after_one_line")
"""Of test_block_compile.py: numerics, recompiles, the 4-bit operator in a graph, a failed compile
(about 80 of the file's 130 CPU-seconds; the rest checks the compile lines and the time bound)."""
SUITE_TESTS = ("test_quantizer_packages.py", "test_blockwise_quantize.py", "test_block_streaming.py",
               *(f"test_block_compile.py::{name}" for name in COMPILE_TESTS),
               "test_atomic_checkpoint.py", "test_torchao_settings.py")
"""The in-trainer tests the user stack runs: the fork's quantizer packages, quantize, stream, compile, resume."""


class UserStackBuild:
    """The user stack of one test run: its workdir, built once, and its in-trainer suite."""

    def __init__(self, tmp_path_factory, suites=None) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.scratch = suites.scratch if suites is not None else None
        self.thread: threading.Thread | None = None
        self.process: subprocess.Popen | None = None
        self.built: Workdir | None = None
        self.suite = None
        self.failure: str | None = None

    def given(self) -> bool:
        return bool(os.environ.get(VARIABLE))

    def start(self) -> None:
        """Start the build (once) and, in a thread, the suite once the build has finished."""
        if self.thread is not None:
            return
        if self.given():
            root, log = Path(os.environ[VARIABLE]), None
        else:
            root = self.tmp_path_factory.mktemp("user-stack")
            self.process, log = start(root)
        self.thread = threading.Thread(target=self.finish, args=(root, log), daemon=True)
        self.thread.start()

    def finish(self, root: Path, log: Path | None) -> None:
        if self.process is not None and self.process.wait() != 0:
            tail = log.read_text(encoding="utf-8", errors="replace")[-6000:]
            self.failure = f"the user stack's build failed ({log}):\n{tail}"
            return
        try:
            self.start_suite(root)
        except Exception as error:  # the test that waits for the suite reports it
            self.failure = f"the user stack's suite did not start: {error!r}"

    def start_suite(self, root: Path) -> None:
        from conftest import FORK
        from in_trainer_suites import SUITE, Suite

        self.built = Workdir(root)
        scratch = self.scratch or self.tmp_path_factory.mktemp("user-stack-suite")
        self.suite = Suite(FORK, self.built, scratch, name="user-stack", tests=tuple(str(SUITE / name) for name in SUITE_TESTS),
                           env={"LAUNCHER_TEST_USER_STACK": json.dumps(USER_STACK_PINS)})

    def workdir(self) -> Workdir:
        """The built workdir; raises AssertionError with the build's log when the build failed."""
        self.thread.join()
        assert self.failure is None, self.failure
        return self.built

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self.thread is not None:
            self.thread.join()
        if self.suite is not None:
            self.suite.stop()


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    build(Path(sys.argv[1]))

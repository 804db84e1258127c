"""Shared fixtures: fixture upstream repositories, and one real trainer workdir per target and run."""

import ctypes
import os
import shutil
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import git
import hypothesis_profile  # noqa: F401  (seeds every Hypothesis test)
import pytest
import yaml
from in_trainer_suites import BackgroundSuites, Suite
from png_bytes import IEND, chunk, ihdr, png
from tiny_run import RUN_NAME, run_tiny
from user_stack import UserStackBuild

from launcher.cli import main
from launcher.envs.workdir import Workdir
from launcher.patching import gitops
from launcher.patching.lock import DEFAULT_LOCK, Target, load_targets
from launcher.patching.series import export_series
from launcher.runs.folders import RunFolder

REPO_ROOT = Path(__file__).resolve().parent.parent
# The in-trainer suite needs torch: tests/test_trainer_patches.py runs it in the trainer venv.
collect_ignore = ["trainer_patches"]
TARGETS = load_targets(DEFAULT_LOCK)
TARGETS_BY_NAME = {target.name: target for target in TARGETS}
FORK = TARGETS[0]

IDENTITY = {
    "GIT_AUTHOR_NAME": "Fixture Author",
    "GIT_AUTHOR_EMAIL": "author@example.invalid",
    "GIT_COMMITTER_NAME": "Fixture Author",
    "GIT_COMMITTER_EMAIL": "author@example.invalid",
    "GIT_AUTHOR_DATE": "2025-01-02T03:04:05+00:00",
    "GIT_COMMITTER_DATE": "2025-01-02T03:04:05+00:00",
}


# The fixture upstreams are git repositories built with git; a Windows interpreter under Wine
# (.ci/windows.sh) has no git.exe to build them with.
UNDER_WINE = os.name == "nt" and hasattr(ctypes.WinDLL("ntdll"), "wine_get_version")
NO_GIT_UNDER_WINE = UNDER_WINE and shutil.which("git") is None


def git_run(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
        env={**os.environ, **IDENTITY},
    ).stdout.strip()


def write_files(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def write_png(path: Path, width: int, height: int) -> Path:
    """A real grey PNG built with the standard library (the launcher's venv has no PIL)."""
    rows = b"".join(b"\x00" + b"\x80" * width for _ in range(height))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png(ihdr(width, height), chunk(b"IDAT", zlib.compress(rows)), IEND))
    return path


class Upstream:
    """A fixture upstream: a git repo the tests commit to, and a lock + series pointing at it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.repo_dir = root / "upstream"
        self.repo_dir.mkdir()
        git_run(self.repo_dir, "init", "-q", "-b", "main")
        write_files(self.repo_dir, {
            "run.py": "print('trainer')\n",
            "requirements.txt": "pyyaml\n",
            "toolkit/__init__.py": "",
            "toolkit/model.py": "".join(f"line {i}\n" for i in range(1, 31)),
            "toolkit/keymaps/big.bin": "pretend this is 4 MiB\n",
            "toolkit/keymaps/nested/more.bin": "x\n",
            "toolkit/util/quantize.py": "def quantize():\n    return 1\n",
            "docs/readme.md": "docs\n",
        })
        self.base = self.commit("upstream base")
        self.lock = root / "upstream.lock"
        self.series = root / "patches" / "fixture" / "series"
        self.series.parent.mkdir(parents=True)
        self.series.write_text("", encoding="utf-8")
        (self.series.parent / "series.sha256").write_text("", encoding="utf-8")
        self.write_lock(self.base)

    @property
    def url(self) -> str:
        return self.repo_dir.as_uri()

    def commit(self, message: str) -> str:
        git_run(self.repo_dir, "add", "-A")
        git_run(self.repo_dir, "commit", "-q", "-m", message)
        return git_run(self.repo_dir, "rev-parse", "HEAD")

    def write_lock(self, commit: str, **extra) -> None:
        target = {
            "name": "fixture", "url": self.url, "commit": commit,
            "series": "patches/fixture/series", "exclude": ["toolkit/keymaps/"], **extra,
        }
        self.lock.write_text(yaml.safe_dump({"targets": [target]}), encoding="utf-8")

    def make_series(self, changes: list[tuple[str, dict[str, str]]], on: str | None = None) -> list[str]:
        """Commit each (subject, files) on a scratch clone of `on` and export them as the series."""
        work = self.root / f"series-work-{len(list(self.root.glob('series-work-*')))}"
        git_run(self.root, "clone", "-q", str(self.repo_dir), str(work))
        git_run(work, "checkout", "-q", on or self.base)
        for subject, files in changes:
            write_files(work, files)
            git_run(work, "add", "-A")
            git_run(work, "commit", "-q", "-m", subject + "\n\nDescription: fixture patch\nWall: none\n")
        patches = export_series(git.Repo(work), on or self.base, "HEAD", self.series)
        return [p.name for p in patches]

    def launcher(self, *args: str) -> int:
        return main(["--lock", str(self.lock), *args])


@pytest.fixture
def upstream(tmp_path) -> Upstream:
    if NO_GIT_UNDER_WINE:
        pytest.skip("no git.exe under Wine")
    return Upstream(tmp_path)


def unreachable_reason(url: str) -> str | None:
    """Why a target's repository cannot be cloned here, or None when it can."""
    try:
        gitops.check_reachable(url)
    except Exception as error:  # LauncherError, or git missing
        return f"{url} cannot be cloned here ({error}); point git at a mirror to run this test"
    return None


def in_ci() -> bool:
    """CI services set CI=true (GitHub Actions, GitLab, ...)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def skip_or_fail_in_ci(reason: str) -> None:
    """Skip with the reason on a developer's machine; fail in CI, so that a CI run cannot pass
    on the fast tests alone when the real targets are out of reach."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: a target that cannot be cloned fails the run)", pytrace=False)
    pytest.skip(reason)


def require_reachable(target: Target) -> Target:
    reason = unreachable_reason(target.url)
    if reason:
        skip_or_fail_in_ci(reason)
    return target


@pytest.fixture(scope="session")
def fork_reachable() -> None:
    require_reachable(FORK)


def workdir_variable(target: str) -> str:
    """The variable naming an existing workdir to reuse: LAUNCHER_TEST_WORKDIR for the first
    target of the lock, LAUNCHER_TEST_WORKDIR_<NAME> (e.g. ..._UPSTREAM_MAIN) for the others."""
    if target == FORK.name:
        return "LAUNCHER_TEST_WORKDIR"
    return "LAUNCHER_TEST_WORKDIR_" + target.upper().replace("-", "_")


class InstalledWorkdirs:
    """A real, patched and installed workdir per target, built once per test run and shared.

    A workdir named by `workdir_variable(target)` is used as it is (for development); otherwise
    `setup --target T --torch-channel cuda` builds one (~6 GB; the targets pin different
    requirements): that is the install test. A failed build fails every test that needs it.
    When the collected tests need every target (one takes a fixture of EVERY_TARGET_FIXTURES), the first
    request builds all of them at the same time, each setup's output in its own log: one pip
    install keeps one core busy (hashing, unpacking, compiling), so two take about the time of one
    on CI's 2 cores (measured, idle 2 cores: the torch trio into a fresh venv 68 s alone, 65 s for
    two at the same time; downloading torch's wheel 6.3 s alone, 5.8 s and 6.2 s for two).
    """

    def __init__(self, tmp_path_factory, needed=(), suites: BackgroundSuites | None = None,
                 user_stack: bool = False) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.needed = needed
        self.suites = suites
        self.failures: dict[str, str] = {}
        self.built: dict[str, Workdir] = {}
        self.user_stack_build = UserStackBuild(tmp_path_factory, suites) if user_stack else None

    def __call__(self, name: str) -> Workdir:
        given = os.environ.get(workdir_variable(name))
        if given:
            return self.ready(name, Workdir(Path(given)))
        if name in self.failures:
            pytest.fail(self.failures[name], pytrace=False)
        if name not in self.built:
            require_reachable(TARGETS_BY_NAME[name])
            self.setup([name, *(other for other in self.needed if self.buildable(other, name))])
            if name in self.failures:
                pytest.fail(self.failures[name], pytrace=False)
        return self.built[name]

    def suite(self, name: str) -> Suite:
        """The target's in-trainer suite, started with its workdir (fails as getting the workdir fails)."""
        self(name)
        return self.suites.suites[name]

    def ready(self, name: str, workdir: Workdir) -> Workdir:
        """A workdir now exists: start its target's in-trainer suite if this run has one."""
        if self.suites is not None:
            self.suites.start(TARGETS_BY_NAME[name], workdir)
        return workdir

    def buildable(self, other: str, name: str) -> bool:
        """Whether to build `other` now, beside `name`: not given, not tried, and reachable."""
        return (other != name and other not in self.built and other not in self.failures
                and not os.environ.get(workdir_variable(other)) and not unreachable_reason(TARGETS_BY_NAME[other].url))

    def user_stack(self) -> UserStackBuild:
        """The user stack's build (tests/user_stack.py), started now if no setup started it yet."""
        if self.user_stack_build is None:
            self.user_stack_build = UserStackBuild(self.tmp_path_factory, self.suites)
        if not self.user_stack_build.given():
            require_reachable(FORK)
        self.user_stack_build.start()
        return self.user_stack_build

    def setup(self, names: list[str]) -> None:
        if self.user_stack_build is not None and not self.user_stack_build.given():
            self.user_stack_build.start()  # a third install beside the targets' (tests/user_stack.py)
        started = {}
        for name in names:
            root = self.tmp_path_factory.mktemp(f"aitk-{name}")
            log = root.with_name(root.name + ".setup.log")
            command = [sys.executable, "-m", "launcher", "setup", "--target", name, "--workdir", str(root),
                       "--torch-channel", "cuda"]
            with log.open("wb") as out:
                started[name] = (root, log, subprocess.Popen(command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT))
        for name, (root, log, process) in started.items():
            if process.wait() == 0:
                self.built[name] = self.ready(name, Workdir(root))
            else:
                tail = log.read_text(encoding="utf-8", errors="replace")[-6000:]
                self.failures[name] = f"launcher setup --target {name} --torch-channel cuda failed ({log}):\n{tail}"


NEEDED_TARGETS = pytest.StashKey[tuple]()
RUNS_SUITES = pytest.StashKey[bool]()
RUNS_USER_STACK = pytest.StashKey[bool]()


@pytest.fixture(scope="session")
def installed_workdirs(request, tmp_path_factory):
    """InstalledWorkdirs, which also starts each target's in-trainer suite in the background as
    soon as its workdir exists when the run selected the bridge (tests/test_trainer_patches.py)."""
    suites = BackgroundSuites(tmp_path_factory.mktemp("in-trainer")) if request.config.stash.get(RUNS_SUITES, False) else None
    workdirs = InstalledWorkdirs(tmp_path_factory, request.config.stash.get(NEEDED_TARGETS, ()), suites,
                                 request.config.stash.get(RUNS_USER_STACK, False))
    yield workdirs
    if suites is not None:
        suites.stop()
    if workdirs.user_stack_build is not None:
        workdirs.user_stack_build.stop()


@pytest.fixture(scope="session")
def trainer_workdir(installed_workdirs) -> Workdir:
    """The first target's (amd-fork's) workdir, which most trainer tests share."""
    return installed_workdirs(FORK.name)


@pytest.fixture(scope="session")
def trainer_checkout(trainer_workdir) -> Path:
    return trainer_workdir.trainer


@dataclass(frozen=True)
class TargetWorkdir:
    target: Target
    workdir: Workdir


@pytest.fixture(scope="session")
def trained_tiny_run(trainer_workdir, tmp_path_factory):
    """(RunFolder, Workdir): the tiny preset trained once per test run in its own output folder,
    for tests that read a finished run (its LoRA, config and logs) rather than watch one."""
    output = tmp_path_factory.mktemp("tiny-run")
    result = run_tiny(trainer_workdir.root, output=output)
    assert result.returncode == 0, result.stdout[-6000:]
    return RunFolder(output / RUN_NAME, RUN_NAME), trainer_workdir


def private_workdir(shared: Workdir, root: Path) -> Workdir:
    """A workdir of one test's own that runs the shared trainer checkout and venv (linked, read
    only) but keeps its own tiny assets and caches: a test that moves or deletes those must not
    do it in the shared workdir, which the in-trainer suite reads at the same time."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "trainer").symlink_to(shared.trainer.resolve(), target_is_directory=True)
    (root / "venv").symlink_to(shared.venv.resolve(), target_is_directory=True)
    for name in ("setup-state.json", "constraints.txt", "trainer-qtypes.json"):
        if (shared.root / name).is_file():
            (root / name).write_bytes((shared.root / name).read_bytes())
    return Workdir(root)


@pytest.fixture(scope="session", params=TARGETS, ids=[t.name for t in TARGETS])
def target_workdir(request, installed_workdirs) -> TargetWorkdir:
    """Each target of upstream.lock in turn, with its installed workdir: tests that must hold
    for every target (the tiny run, the in-trainer suite) take this one."""
    return TargetWorkdir(request.param, installed_workdirs(request.param.name))


# --- markers -------------------------------------------------------------------------------------

TRAINER_FIXTURES = {"fork_reachable", "trainer_workdir", "trainer_checkout", "target_workdir",
                    "installed_workdirs", "reachable_target", "trained_tiny_run", "user_stack"}
"""Fixtures that need a real target: whoever uses one must carry the `trainer` marker."""
EVERY_TARGET_FIXTURES = {"target_workdir", "in_trainer_suites"}
"""Fixtures that need the workdir of every target (the bridge's is tests/test_trainer_patches.py's)."""


def pytest_collection_modifyitems(config, items):
    """Keep `-m "not trainer"` honest: a test that needs a real target but lacks the marker
    would run (and build ~6 GB) in the quick run, so name it and stop."""
    unmarked = [item.nodeid for item in items
                if TRAINER_FIXTURES & set(getattr(item, "fixturenames", ())) and not item.get_closest_marker("trainer")]
    if unmarked:
        raise pytest.UsageError("these tests need a real target but are not marked `trainer`: " + ", ".join(unmarked))


def pytest_collection_finish(session):
    """The targets whose workdirs this run will build: all of them when a selected test takes a
    fixture of EVERY_TARGET_FIXTURES (InstalledWorkdirs then builds them together)."""
    every = any(EVERY_TARGET_FIXTURES & set(getattr(item, "fixturenames", ())) for item in session.items)
    session.config.stash[NEEDED_TARGETS] = tuple(target.name for target in TARGETS) if every else ()
    session.config.stash[RUNS_SUITES] = any("in_trainer_suites" in getattr(item, "fixturenames", ()) for item in session.items)
    session.config.stash[RUNS_USER_STACK] = any("user_stack" in getattr(item, "fixturenames", ()) for item in session.items)


@pytest.fixture(scope="session")
def user_stack(installed_workdirs) -> UserStackBuild:
    """The rocm-windows channel's versions built on Linux (tests/user_stack.py), shared by
    tests/test_user_stack.py; the run builds it beside the targets' workdirs."""
    return installed_workdirs.user_stack()

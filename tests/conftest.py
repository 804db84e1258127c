"""Shared fixtures: fixture upstream repositories, and one real trainer workdir per run."""

import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import git
import pytest
import yaml

from launcher.cli import main
from launcher.envs.workdir import Workdir
from launcher.patching import gitops
from launcher.patching.lock import DEFAULT_LOCK, load_targets
from launcher.patching.series import export_series
from launcher.runs.folders import RunFolder

REPO_ROOT = Path(__file__).resolve().parent.parent
# The in-trainer suite needs torch: tests/test_trainer_patches.py runs it in the trainer venv.
collect_ignore = ["trainer_patches"]
FORK = load_targets(DEFAULT_LOCK)[0]

IDENTITY = {
    "GIT_AUTHOR_NAME": "Fixture Author",
    "GIT_AUTHOR_EMAIL": "author@example.invalid",
    "GIT_COMMITTER_NAME": "Fixture Author",
    "GIT_COMMITTER_EMAIL": "author@example.invalid",
    "GIT_AUTHOR_DATE": "2025-01-02T03:04:05+00:00",
    "GIT_COMMITTER_DATE": "2025-01-02T03:04:05+00:00",
}


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
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + b"\x80" * width for _ in range(height))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
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
    return Upstream(tmp_path)


def unreachable_reason(url: str) -> str | None:
    """Why a target's repository cannot be cloned here, or None when it can."""
    try:
        gitops.check_reachable(url)
    except Exception as error:  # LauncherError, or git missing
        return f"{url} cannot be cloned here ({error}); point git at a mirror to run this test"
    return None


@pytest.fixture(scope="session")
def fork_reachable() -> None:
    reason = unreachable_reason(FORK.url)
    if reason:
        pytest.skip(reason)


def installed_workdir(target: str, variable: str, tmp_path_factory) -> Workdir:
    """A real, patched and installed workdir of one target, built once per test session.

    The environment variable names an existing workdir to use as it is (for development);
    otherwise `setup --target T --torch-channel cuda` builds one: that is the install test.
    """
    given = os.environ.get(variable)
    if given:
        return Workdir(Path(given))
    url = next(t.url for t in load_targets(DEFAULT_LOCK) if t.name == target)
    reason = unreachable_reason(url)
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp(f"aitk-{target}")
    result = subprocess.run(
        [sys.executable, "-m", "launcher", "setup", "--target", target, "--workdir", str(root),
         "--torch-channel", "cuda"],
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, f"launcher setup --target {target} --torch-channel cuda failed; its output is above"
    return Workdir(root)


@pytest.fixture(scope="session")
def trainer_workdir(tmp_path_factory) -> Workdir:
    """The amd-fork workdir every trainer test shares (LAUNCHER_TEST_WORKDIR reuses one)."""
    return installed_workdir(FORK.name, "LAUNCHER_TEST_WORKDIR", tmp_path_factory)


@pytest.fixture(scope="session")
def trainer_checkout(trainer_workdir) -> Path:
    return trainer_workdir.trainer


# each target of upstream.lock -> the session fixture giving its installed workdir
WORKDIR_FIXTURES = {"amd-fork": "trainer_workdir", "upstream-main": "upstream_main_workdir"}


@pytest.fixture(scope="session")
def upstream_main_workdir(tmp_path_factory) -> Workdir:
    """Upstream ai-toolkit pins other requirements than the fork (transformers, diffusers, ...),
    so it gets its own venv (LAUNCHER_TEST_WORKDIR_UPSTREAM_MAIN reuses one)."""
    return installed_workdir("upstream-main", "LAUNCHER_TEST_WORKDIR_UPSTREAM_MAIN", tmp_path_factory)


@pytest.fixture(scope="session")
def trained_tiny_run(trainer_workdir, tmp_path_factory):
    """(RunFolder, Workdir): the tiny preset trained once per session in its own output folder,
    for tests that read a finished run (its LoRA, config and logs) rather than watch one."""
    output = tmp_path_factory.mktemp("tiny-run")
    result = subprocess.run(
        [sys.executable, "-m", "launcher", "run", "tiny", "--workdir", str(trainer_workdir.root),
         "--output", str(output)],
        cwd=REPO_ROOT, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    return RunFolder(output / "tiny_flux2", "tiny_flux2"), trainer_workdir

"""Prove that each WALLS.md guard fails without its patch: revert the patch in a scratch checkout,
run the in-trainer tests WALLS.md names under "guarded by" for it, and expect a failure.

Not part of the test suite (a run per patch takes minutes): run it after changing a patch or a
guard, with the trainer venv of a workdir made by `python -m launcher setup --workdir W`:

    python tests/prove_guards.py --workdir W                       # every patch WALLS.md names
    python tests/prove_guards.py --workdir W --only no-host-sync   # patches whose file name has this

For each patch it prints `fails without it` (the guard works), `PASSES without it` (the guard does
not guard: exit status 1), `not revertible` or `no in-trainer guard` (its guards run in the
launcher's venv). A patch that later patches build on (its revert conflicts) is reverted together
with the later ones that change its files (or, where that still conflicts, with every later one),
newest first, and the verdict names them: the guard then fails without the whole group, which
still proves it is not vacuous. The scratch checkout
is a `git worktree` of W/trainer, removed afterwards; W itself is not changed.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUITE = REPO / "tests" / "trainer_patches"
PATCH = re.compile(r"`(\d{4}-[^`]+\.patch)`")


def guard_files(cell: str) -> list[str]:
    """The in-trainer test files a "guarded by" cell names. A bare `test_x.py` is in the folder of
    the last path before it (`tests/trainer_patches/test_a.py`, `test_b.py`: both in-trainer)."""
    folder, found = None, []
    for name in re.findall(r"`([^`]+\.py)`", cell):
        if "/" in name:
            folder, name = name.rsplit("/", 1)
        if folder == "tests/trainer_patches" and name.startswith("test_") and name not in found:
            found.append(name)
    return found


def guards(walls: Path) -> dict[str, list[str]]:
    """{patch file name: in-trainer test files named in the last column of each row naming it}."""
    found: dict[str, list[str]] = {}
    for line in walls.read_text(encoding="utf-8").splitlines():
        cells = line.strip().strip("|").split(" | ")
        if not line.startswith("|") or len(cells) < 3:
            continue
        tests = guard_files(cells[-1])
        for patch in PATCH.findall(" | ".join(cells[:-1])):
            found.setdefault(patch, []).extend(t for t in tests if t not in found[patch])
    return found


def patch_commit(checkout: Path, patch: str) -> str | None:
    """The checkout's commit made from `patch` (its subject is the patch's slug with spaces)."""
    slug = patch.split("-", 1)[1].removesuffix(".patch")
    log = subprocess.run(["git", "-C", str(checkout), "log", "--format=%H %s"], capture_output=True, text=True,
                         check=True).stdout
    for line in log.splitlines():
        sha, subject = line.split(" ", 1)
        if re.sub(r"[^A-Za-z0-9_.]+", "-", subject).startswith(slug[:40]):
            return sha
    return None


def git(tree: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True)


def revert(tree: Path, sha: str) -> list[str] | None:
    """Revert `sha` in the work tree (nothing committed). When later patches build on it, revert
    first those that change its files, else every later one, newest first. The subjects of the
    extra reverts, or None."""
    files = git(tree, "show", "--format=", "--name-only", sha).stdout.split()
    for later in ([], git(tree, "log", "--format=%H", f"{sha}..HEAD", "--", *files).stdout.split(),
                  git(tree, "log", "--format=%H", f"{sha}..HEAD").stdout.split()):
        if all(git(tree, "revert", "--no-commit", commit).returncode == 0 for commit in [*later, sha]):
            return [git(tree, "log", "-1", "--format=%s", commit).stdout.strip() for commit in later]
        git(tree, "revert", "--abort")
        git(tree, "reset", "-q", "--hard")
    return None


def without(workdir: Path, patch: str, tests: list[str]) -> str:
    checkout = workdir / "trainer"
    sha = patch_commit(checkout, patch)
    if sha is None:
        return "not in this checkout"
    with tempfile.TemporaryDirectory(prefix="guards-") as scratch:
        tree = Path(scratch) / "trainer"
        subprocess.run(["git", "-C", str(checkout), "worktree", "add", "-q", "--detach", str(tree)], check=True)
        try:
            also = revert(tree, sha)
            if also is None:
                return "not revertible"
            (Path(scratch) / "venv").symlink_to(workdir / "venv", target_is_directory=True)
            python = workdir / "venv" / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
            env = {**os.environ, "LAUNCHER_TEST_WORKDIR": scratch, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
            run = subprocess.run([str(python), "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-c",
                                  str(SUITE / "pytest.ini"), "--confcutdir", str(SUITE), "-m", "not gpu",
                                  *[str(SUITE / t) for t in tests]], cwd=REPO, env=env, capture_output=True, text=True)
            verdict = "fails without it" if run.returncode == 1 else \
                "PASSES without it" if run.returncode == 0 else f"pytest exit {run.returncode}"
            return verdict + (f" (and without {len(also)} later patch(es) on its files: {'; '.join(also)})"
                              if also else "")
        finally:
            subprocess.run(["git", "-C", str(checkout), "worktree", "remove", "--force", str(tree)], capture_output=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True, help="a workdir made by `setup` (its trainer and venv)")
    parser.add_argument("--only", default="", help="only patches whose file name contains this")
    args = parser.parse_args(argv)
    broken = 0
    for patch, tests in guards(REPO / "WALLS.md").items():
        if args.only not in patch:
            continue
        verdict = without(args.workdir.resolve(), patch, tests) if tests else "no in-trainer guard"
        broken += verdict.startswith("PASSES")
        print(f"{patch}: {verdict} ({', '.join(tests) or '-'})", flush=True)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())

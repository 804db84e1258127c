"""Prove that each WALLS.md guard fails without its patch: revert the patch in a scratch checkout,
run the tests WALLS.md names under "guarded by" for it, and expect a failure.

Not part of the test suite (a run per patch takes minutes): run it after changing a patch or a
guard, with the trainer venv of a workdir made by `python -m launcher setup --workdir W`:

    python tests/prove_guards.py --workdir W                       # every patch WALLS.md names
    python tests/prove_guards.py --workdir W --only no-host-sync   # patches whose file name has this

The in-trainer tests of the row (tests/trainer_patches/, under W's venv) run first; where none
fails, the row's launcher-side trainer tests (tests/, marker `trainer`, the amd-fork target only)
run with the scratch checkout as their workdir. For each patch it prints `fails without it` and
the first test that failed (the guard works), `PASSES without it` (the guard does not guard:
exit status 1), `not revertible` or `no guard named`. A patch that later patches build on (its revert conflicts) is reverted together
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


def guard_files(cell: str) -> dict[str, list[str]]:
    """{"in_trainer": [...], "launcher": [...]}: the test files a "guarded by" cell names. A bare
    `test_x.py` is in the folder of the last path before it (`tests/trainer_patches/test_a.py`,
    `test_b.py`: both in-trainer)."""
    folder, found = None, {"in_trainer": [], "launcher": []}
    for name in re.findall(r"`([^`]+\.py)`", cell):
        if "/" in name:
            folder, name = name.rsplit("/", 1)
        kind = {"tests/trainer_patches": "in_trainer", "tests": "launcher"}.get(folder)
        if kind and name.startswith("test_") and name not in found[kind]:
            found[kind].append(name)
    return found


def guards(walls: Path) -> dict[str, dict[str, list[str]]]:
    """{patch file name: the test files of the last column of each row naming it}."""
    found: dict[str, dict[str, list[str]]] = {}
    for line in walls.read_text(encoding="utf-8").splitlines():
        cells = line.strip().strip("|").split(" | ")
        if not line.startswith("|") or len(cells) < 3:
            continue
        files = guard_files(cells[-1])
        for patch in PATCH.findall(" | ".join(cells[:-1])):
            mine = found.setdefault(patch, {"in_trainer": [], "launcher": []})
            for kind, names in files.items():
                mine[kind].extend(name for name in names if name not in mine[kind])
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


def first_failure(run: subprocess.CompletedProcess) -> str | None:
    """The first test pytest reports FAILED or ERROR; None when it passed or selected nothing."""
    if run.returncode not in (1, 2):
        return None
    for line in run.stdout.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" ")[1]
    return f"pytest exit {run.returncode}"


def run_guards(scratch: str, workdir: Path, files: dict[str, list[str]]) -> str | None:
    """The first guard test that fails against the scratch checkout, or None."""
    env = {**os.environ, "LAUNCHER_TEST_WORKDIR": scratch, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    python = workdir / "venv" / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    common = ["-m", "pytest", "-q", "-x", "-rfE", "-p", "no:cacheprovider"]
    if files["in_trainer"]:
        run = subprocess.run([str(python), *common, "-c", str(SUITE / "pytest.ini"), "--confcutdir", str(SUITE),
                              "-m", "not gpu", *[str(SUITE / t) for t in files["in_trainer"]]],
                             cwd=REPO, env=env, capture_output=True, text=True)
        failed = first_failure(run)
        if failed:
            return failed
    if files["launcher"]:
        run = subprocess.run([sys.executable, *common, "-m", "trainer and not gpu", "-k", "not upstream",
                              *[str(REPO / "tests" / t) for t in files["launcher"]]],
                             cwd=REPO, env=env, capture_output=True, text=True)
        return first_failure(run)
    return None


def without(workdir: Path, patch: str, files: dict[str, list[str]]) -> str:
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
            failed = run_guards(scratch, workdir, files)
            verdict = f"fails without it ({failed})" if failed else "PASSES without it"
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
    for patch, files in guards(REPO / "WALLS.md").items():
        if args.only not in patch:
            continue
        named = files["in_trainer"] + files["launcher"]
        verdict = without(args.workdir.resolve(), patch, files) if named else "no guard named"
        broken += verdict.startswith("PASSES")
        print(f"{patch}: {verdict} [{', '.join(named) or '-'}]", flush=True)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())

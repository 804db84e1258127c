"""Git plumbing through GitPython: clone, sparse checkout, apply, commit, compare trees.

Every git call runs with GIT_LFS_SKIP_SMUDGE=1 and without pagers or prompts, so a
missing credential fails fast instead of waiting for input.
"""

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import git

from launcher.errors import LauncherError

GIT_ENV = {
    "GIT_LFS_SKIP_SMUDGE": "1",
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_PAGER": "cat",
    "GIT_ADVICE": "0",
}

MIRROR_HINT = (
    "If GitHub is not reachable from this machine, point git at a mirror:\n"
    "  git config --global url.<mirror>.insteadOf {url}"
)


def require_git() -> None:
    """Fail with an actionable message when the git executable is missing."""
    if shutil.which(os.environ.get("GIT_PYTHON_GIT_EXECUTABLE", "git")) is None:
        raise LauncherError(
            "git was not found on PATH. Install Git (https://git-scm.com/downloads; on Windows "
            "'winget install Git.Git'), open a new terminal, and run the command again."
        )
    git.refresh()


def _cmd(repo: git.Repo) -> git.cmd.Git:
    repo.git.update_environment(**GIT_ENV)
    return repo.git


def check_reachable(url: str) -> None:
    """Ask the remote for its refs; an unreachable URL becomes a LauncherError naming it."""
    require_git()
    try:
        git.cmd.Git().execute(["git", "ls-remote", "--heads", url], env={**os.environ, **GIT_ENV})
    except git.GitCommandError as error:
        raise LauncherError(
            f"cannot reach {url}: {_last_line(error)}\n" + MIRROR_HINT.format(url=url)
        ) from None


def clone(url: str, dest: Path, progress=None) -> git.Repo:
    """Clone without checking anything out; the sparse checkout comes next."""
    check_reachable(url)
    try:
        return git.Repo.clone_from(
            url, dest, no_checkout=True, progress=progress, env={**os.environ, **GIT_ENV}
        )
    except git.GitCommandError as error:
        raise LauncherError(f"cloning {url} failed: {_last_line(error)}") from None


def has_commit(repo: git.Repo, commit: str) -> bool:
    try:
        _cmd(repo).cat_file("-e", f"{commit}^{{commit}}")
        return True
    except git.GitCommandError:
        return False


def fetch_commit(repo: git.Repo, ref: str) -> str:
    """Make `ref` (commit, tag or branch of origin) present locally; return its full hash."""
    if not has_commit(repo, ref):
        try:
            _cmd(repo).fetch("origin", ref, "--tags")
        except git.GitCommandError:
            pass
    for candidate in (ref, f"origin/{ref}"):
        if has_commit(repo, candidate):
            return _cmd(repo).rev_parse(f"{candidate}^{{commit}}")
    raise LauncherError(
        f"commit or ref {ref} is not in the clone of {repo.remotes.origin.url}. Check the "
        "commit in upstream.lock (or --ref), or fetch it into the mirror you point git at."
    )


def cone_directories(repo: git.Repo, commit: str, exclude: list[str]) -> list[str]:
    """Directories that a cone-mode sparse checkout lists to leave out `exclude`.

    Cone mode can only include directories, so an excluded folder is left out by listing
    every sibling along its path instead of its parent (files directly in the parents
    are always part of the cone).
    """
    excluded = [e.strip("/") for e in exclude]
    for path in excluded:
        if _cmd(repo).ls_tree("-d", "--name-only", commit, "--", path) != path:
            raise LauncherError(
                f"exclude entry {path}/ is not a directory at {commit[:12]}; fix `exclude` in upstream.lock"
            )
    keep: list[str] = []

    def walk(folder: str) -> None:
        listing = _cmd(repo).ls_tree("-d", "--name-only", commit, *([f"{folder}/"] if folder else []))
        for child in filter(None, listing.splitlines()):
            if child in excluded:
                continue
            if any(e.startswith(child + "/") for e in excluded):
                walk(child)
            else:
                keep.append(child)

    walk("")
    return keep


def checkout_sparse(repo: git.Repo, commit: str, branch: str, exclude: list[str]) -> None:
    """Check out `commit` on a new `branch`, without the excluded folders."""
    if exclude:
        directories = cone_directories(repo, commit, exclude)
        _cmd(repo).sparse_checkout("set", "--cone", "--sparse-index", *directories)
    _cmd(repo).checkout("-q", "-B", branch, commit)


def widen_sparse(repo: git.Repo, directories: list[str]) -> None:
    """Take new top-level `directories` into a cone-mode sparse checkout (the contract package is
    outside the cone `checkout_sparse` set); nothing without a sparse checkout."""
    if directories and (Path(repo.git_dir) / "info" / "sparse-checkout").is_file():
        _cmd(repo).sparse_checkout("add", *directories)


@dataclass(frozen=True)
class ApplyResult:
    status: str  # "clean", "3-way" or "conflict"
    files: list[str]
    detail: str


def apply_patch(repo: git.Repo, patch: Path, allow_3way: bool) -> ApplyResult:
    """Apply one patch to the index and work tree; never leaves a half-applied clean patch."""
    files = patch_files(repo, patch)
    try:
        _cmd(repo).apply("--index", "--whitespace=nowarn", str(patch))
        return ApplyResult("clean", files, "")
    except git.GitCommandError as error:
        clean_error = _stderr(error)
    if not allow_3way:
        return ApplyResult("conflict", files, clean_error)
    try:
        _cmd(repo).apply("--3way", "--index", "--whitespace=nowarn", str(patch))
        return ApplyResult("3-way", files, clean_error)
    except git.GitCommandError as error:
        unmerged = _cmd(repo).diff("--name-only", "--diff-filter=U").splitlines()
        return ApplyResult("conflict", unmerged or files, _stderr(error))


def patch_files(repo: git.Repo, patch: Path) -> list[str]:
    """Paths a patch touches, read by git itself (`git apply --numstat`)."""
    numstat = _cmd(repo).apply("--numstat", str(patch))
    return [line.split("\t", 2)[2] for line in numstat.splitlines() if line.count("\t") >= 2]


def commit_as(repo: git.Repo, message: str, author: str, email: str, date: str) -> str:
    """Commit the index with the patch's author and date as both author and committer.

    Using the patch's identity for the committer too makes the resulting hashes depend
    only on the base commit and the patch files, so two setups produce the same history.
    """
    identity = {
        "GIT_AUTHOR_NAME": author,
        "GIT_AUTHOR_EMAIL": email,
        "GIT_AUTHOR_DATE": date,
        "GIT_COMMITTER_NAME": author,
        "GIT_COMMITTER_EMAIL": email,
        "GIT_COMMITTER_DATE": date,
    }
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".msg", delete=False) as handle:
        handle.write(message)
    try:
        _cmd(repo).execute(
            ["git", "commit", "-q", "--no-verify", "--allow-empty", "--cleanup=verbatim", "-F", handle.name],
            env={**os.environ, **GIT_ENV, **identity},
        )
    finally:
        os.unlink(handle.name)
    return repo.head.commit.hexsha


def expected_trees(repo: git.Repo, base: str, patches: list[Path]) -> list[str | None]:
    """Tree hash after each patch, computed in a scratch index; None from the first failure on.

    The work tree and the real index are never touched, so this can judge a checkout
    the user may have edited.
    """
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, **GIT_ENV, "GIT_INDEX_FILE": str(Path(scratch) / "index")}
        run = _cmd(repo).execute
        run(["git", "read-tree", base], env=env)
        trees: list[str | None] = []
        for patch in patches:
            try:
                run(["git", "apply", "--cached", "--whitespace=nowarn", str(patch)], env=env)
            except git.GitCommandError:
                break
            trees.append(run(["git", "write-tree", "--missing-ok"], env=env))
        return trees + [None] * (len(patches) - len(trees))


def worktree_changes(repo: git.Repo) -> list[str]:
    """Modified, staged and untracked (not ignored) paths, as `git status --porcelain` lines."""
    return [line for line in _cmd(repo).status("--porcelain").splitlines() if line.strip()]


PYTHON_CODE_SUFFIXES = (".py", ".pyc", ".pyo", ".pth", ".so", ".pyd")
"""Files Python executes or loads: sources, bytecode, path hooks, extension modules."""


def ignored_code(repo: git.Repo) -> list[str]:
    """Ignored files Python would execute: `git status` does not list them (`__pycache__` bytecode
    carrying its source's mtime and size runs instead of the source)."""
    listed = _cmd(repo).ls_files("--others", "--ignored", "--exclude-standard", "-z")
    return sorted(path for path in listed.split("\0") if path.lower().endswith(PYTHON_CODE_SUFFIXES))


def remove_tree(path: Path) -> None:
    """rmtree that also removes git's read-only object files on Windows."""

    def make_writable_and_retry(function, failed, _excinfo):
        Path(failed).chmod(0o700)
        function(failed)

    shutil.rmtree(path, onerror=make_writable_and_retry)


def _stderr(error: git.GitCommandError) -> str:
    return (error.stderr or "").strip().removeprefix("stderr:").strip(" '\n")


def _last_line(error: git.GitCommandError) -> str:
    lines = [line for line in _stderr(error).splitlines() if line.strip()]
    return lines[-1] if lines else str(error)

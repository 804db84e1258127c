"""The overlay: the trainer modules that are new files, kept once in the project.

New trainer modules (the streamed reader, the quantized cache, the 4-bit Linear, ...) are
the same on every target, so they live once under `overlay/`, laid out like the trainer's
tree, instead of inside every target's patches. The contract package (`flux2_contract/`: the
rules both the launcher and the trainer apply) rides in the same commit, under its own name
beside the trainer's run.py, so the trainer imports the very files the launcher imports. `setup` commits them into the checkout as
the first commit above the locked commit; the target's series then holds only the hooks
into upstream's own files. The commit is made with a fixed identity and date, so its hash
depends only on the base commit and the overlay's content.
"""

import hashlib
import os
import tempfile
from pathlib import Path

import git

from launcher.errors import LauncherError
from launcher.patching import gitops
from launcher.patching.lock import Target
from launcher.writer import replace_own

SUBJECT = "flux2-24gb: the project's own trainer modules"
MESSAGE = (
    f"{SUBJECT}\n\n"
    "New files only, kept once in the project's overlay/ folder and shared by every target;\n"
    "the patches that follow hook them into the trainer.\n"
)
AUTHOR = "flux2-24gb maintainers"
EMAIL = "maintainers@flux2-24gb.invalid"
DATE = "2026-11-30T00:00:00+00:00"
SKIPPED_PARTS = {"__pycache__"}


def read_overlay(folder: Path | None) -> dict[str, bytes]:
    """{path relative to the trainer root, posix: content} of every file in the overlay."""
    if folder is None or not folder.is_dir():
        return {}
    files = {}
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if path.is_file() and not SKIPPED_PARTS.intersection(relative.parts) and path.suffix != ".pyc":
            files[relative.as_posix()] = path.read_bytes()
    return files


def trainer_files(target: Target) -> dict[str, bytes]:
    """{path in the trainer checkout: content} of what the overlay commit adds: the overlay's files
    and the contract package's, the latter under the package's own folder name."""
    files = read_overlay(target.overlay)
    package = read_overlay(target.contract)
    files.update({f"{target.contract.name}/{name}": content for name, content in package.items()})
    return files


def digest(files: dict[str, bytes]) -> str:
    """One hash of the overlay's names and contents, for the setup state."""
    total = hashlib.sha256()
    for name in sorted(files):
        total.update(f"{name}\0{hashlib.sha256(files[name]).hexdigest()}\n".encode())
    return total.hexdigest()


def commit(repo: git.Repo, files: dict[str, bytes]) -> str | None:
    """Write the overlay into the work tree and commit it; None when there is nothing to add."""
    if not files:
        return None
    clashes = [name for name in files if _exists(repo, "HEAD", name)]
    if clashes:
        raise LauncherError(
            f"upstream now has files the overlay adds: {', '.join(clashes)}. Compare them; drop the "
            "overlay's copy if upstream's does the same, or rename the module and its hooks."
        )
    new_folders = {name.split("/")[0] for name in files if "/" in name}
    gitops.widen_sparse(repo, sorted(folder for folder in new_folders if not _exists(repo, "HEAD", folder)))
    root = Path(repo.working_tree_dir)
    for name, content in files.items():
        replace_own(root / name, content, root)
    repo.git.add("--", *files)
    return gitops.commit_as(repo, MESSAGE, AUTHOR, EMAIL, DATE)


def tree(repo: git.Repo, base: str, files: dict[str, bytes]) -> str:
    """The tree the overlay commit must have: `base` plus the files, built in a scratch index."""
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, **gitops.GIT_ENV, "GIT_INDEX_FILE": str(Path(scratch) / "index")}
        run = repo.git.execute
        run(["git", "read-tree", base], env=env)
        for name, content in files.items():
            blob = _hash_object(repo, content)
            run(["git", "update-index", "--add", "--cacheinfo", f"100644,{blob},{name}"], env=env)
        return run(["git", "write-tree", "--missing-ok"], env=env)


def split_history(repo: git.Repo, base: str, head: str = "HEAD") -> tuple[str, str | None]:
    """(where the series starts, the overlay commit or None): the overlay commit is the first above base."""
    first = list(repo.iter_commits(f"{base}..{head}", first_parent=True, reverse=True))[:1]
    if first and first[0].summary == SUBJECT:
        return first[0].hexsha, first[0].hexsha
    return base, None


def new_files(repo: git.Repo, base: str, head: str) -> list[str]:
    """Files that exist at `head` but not at `base`: what belongs in the overlay."""
    return repo.git.diff("--name-only", "--no-renames", "--diff-filter=A", base, head).splitlines()


def export(repo: git.Repo, base: str, head: str, folder: Path, contract: Path | None = None) -> list[str]:
    """Make `folder` hold exactly the files `head` adds to `base`, and `contract` those under its
    folder name (the contract package); the names that changed."""
    wanted = {name: repo.git.execute(["git", "cat-file", "blob", f"{head}:{name}"], stdout_as_string=False,
                                       strip_newline_in_stdout=False)
              for name in new_files(repo, base, head)}
    if contract is None:
        return _mirror(folder, wanted)
    prefix = f"{contract.name}/"
    package = {name.removeprefix(prefix): content for name, content in wanted.items() if name.startswith(prefix)}
    rest = {name: content for name, content in wanted.items() if not name.startswith(prefix)}
    return _mirror(folder, rest) + [prefix + name for name in _mirror(contract, package)]


def _mirror(folder: Path, wanted: dict[str, bytes]) -> list[str]:
    """Make `folder` hold exactly `wanted`; the names that changed."""
    current = read_overlay(folder)
    changed = sorted(name for name in set(wanted) | set(current) if wanted.get(name) != current.get(name))
    for name in changed:
        path = folder / name
        if name in wanted:
            replace_own(path, wanted[name], folder)
        else:
            path.unlink()
    return changed


def _exists(repo: git.Repo, rev: str, name: str) -> bool:
    try:
        repo.git.execute(["git", "cat-file", "-e", f"{rev}:{name}"])
        return True
    except git.GitCommandError:
        return False


def _hash_object(repo: git.Repo, content: bytes) -> str:
    with tempfile.NamedTemporaryFile(delete=False) as handle:
        handle.write(content)
    try:
        return repo.git.execute(["git", "hash-object", "-w", "--no-filters", handle.name]).strip()
    finally:
        os.unlink(handle.name)

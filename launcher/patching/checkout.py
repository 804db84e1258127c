"""The patched trainer checkout: build it from the lock, and judge an existing one.

A checkout is the lock's commit, the overlay commit (the project's new trainer files),
then one commit per patch, in series order, on the branch `patched`. Commits are made with the patch's own identity and date, so the
history reads as the series and is the same on every machine.
"""

import json
from pathlib import Path

import git
from git.remote import RemoteProgress

from launcher.errors import LauncherError
from launcher.patching import gitops, overlay
from launcher.patching.lock import Target
from launcher.patching.series import Patch, read_message
from launcher.progress import say, step
from launcher.writer import publish_folder, replace_own

BRANCH = "patched"


class CloneProgress(RemoteProgress):
    """One line per clone stage and every tenth of the way, readable in a log file."""

    STAGES = {
        RemoteProgress.COUNTING: "counting objects",
        RemoteProgress.COMPRESSING: "compressing objects",
        RemoteProgress.RECEIVING: "receiving objects",
        RemoteProgress.RESOLVING: "resolving deltas",
    }

    def __init__(self) -> None:
        super().__init__()
        self._shown: set[tuple[int, int]] = set()

    def update(self, op_code, cur_count, max_count=None, message=""):
        stage = op_code & self.OP_MASK
        tenth = int(10 * cur_count / max_count) if max_count else 0
        if stage in self.STAGES and (stage, tenth) not in self._shown:
            self._shown.add((stage, tenth))
            total = f"/{int(max_count)}" if max_count else ""
            say(f"  {self.STAGES[stage]}: {int(cur_count)}{total}")


def build(target: Target, patches: list[Patch], dest: Path) -> git.Repo:
    """Clone, pin, check out without the excluded folders, apply the series as commits.

    Work happens in `<dest>.partial` and is renamed to `dest` only when everything
    applied, so `dest` never holds a half-patched tree.
    """
    partial = dest.with_name(dest.name + ".partial")
    if partial.exists():
        say(f"removing the incomplete checkout left by an earlier attempt: {partial}")
        gitops.remove_tree(partial)
    with step(f"cloning {target.url}"):
        repo = gitops.clone(target.url, partial, progress=CloneProgress())
    if not gitops.has_commit(repo, target.commit):
        raise LauncherError(
            f"commit {target.commit} (upstream.lock, target {target.name}) is not in {target.url}. "
            "Fix the commit in upstream.lock, or point git at a mirror that has it."
        )
    with step(f"checking out {target.commit[:12]} without {', '.join(target.exclude) or 'nothing'}"):
        gitops.checkout_sparse(repo, target.commit, BRANCH, target.exclude)
    if repo.head.commit.hexsha != target.commit:
        raise LauncherError(f"HEAD of {partial} is {repo.head.commit.hexsha}, not {target.commit}")
    files = overlay.trainer_files(target)
    if overlay.commit(repo, files):
        say(f"  added the overlay: {len(files)} new trainer files")
    apply_series(repo, patches, target)
    repo.close()
    publish_folder(partial, dest)
    return git.Repo(dest)


def apply_series(repo: git.Repo, patches: list[Patch], target: Target) -> None:
    """Apply each patch cleanly (no 3-way, no fuzz) and commit it with its own message."""
    for number, patch in enumerate(patches, 1):
        result = gitops.apply_patch(repo, patch.path, allow_3way=False)
        if result.status != "clean":
            raise LauncherError(
                f"patch {patch.name} does not apply to {target.commit[:12]} "
                f"(files: {', '.join(result.files)}).\n{result.detail}\n"
                f"Show the conflict with:\n  git -C {repo.working_tree_dir} apply --check -v {patch.path}\n"
                f"or list every patch's state with `python -m launcher patches check --target {target.name}`. "
                "The series was written for the commit in upstream.lock; if you changed that commit, "
                "rebase the series first."
            )
        info = read_message(patch.path)
        gitops.commit_as(repo, info.message, info.author, info.email, info.date)
        say(f"  [{number}/{len(patches)}] applied {patch.name}")


def problems(trainer: Path, target: Target, patches: list[Patch]) -> list[str]:
    """Everything that makes `trainer` differ from the lock's commit plus the series."""
    if not (trainer / ".git").exists():
        return [f"{trainer} is not a git checkout"]
    repo = git.Repo(trainer)
    if not gitops.has_commit(repo, target.commit):
        return [f"{trainer} does not contain the locked commit {target.commit[:12]} of target {target.name}"]
    head = repo.head.commit.hexsha
    if not repo.is_ancestor(target.commit, head):
        return [f"{trainer} is at {head[:12]}, which is not built on the locked commit {target.commit[:12]}"]
    found = list(problems_in_history(repo, target.commit, patches, overlay.trainer_files(target)))
    found += [f"uncommitted change: {line}" for line in gitops.worktree_changes(repo)]
    found += [f"ignored file Python would execute: {path} (not in the lock, overlay or series; delete it)"
              for path in gitops.ignored_code(repo)]
    return found


def problems_in_history(repo: git.Repo, base: str, patches: list[Patch], files: dict[str, bytes]):
    """Compare the overlay commit and each patch's commit above `base` with what they produce."""
    commits = list(repo.iter_commits(f"{base}..HEAD", first_parent=True, reverse=True))
    if files:
        expected = overlay.tree(repo, base, files)
        first = commits.pop(0) if commits and commits[0].summary == overlay.SUBJECT else None
        if first is None:
            yield "the overlay commit (the project's trainer modules) is missing"
            return
        if first.tree.hexsha != expected:
            yield f"commit {first.hexsha[:12]} ({first.summary}) differs from the project's overlay/ folder and contract package"
        base = expected
    trees = gitops.expected_trees(repo, base, [p.path for p in patches])
    for index, patch in enumerate(patches):
        if index >= len(commits):
            yield f"patch {patch.name} is not applied"
            continue
        commit = commits[index]
        if trees[index] is None:
            yield f"patch {patch.name} no longer applies on top of the previous patches"
        elif commit.tree.hexsha != trees[index]:
            yield f"commit {commit.hexsha[:12]} ({commit.summary}) changes other files than patch {patch.name}"
        elif commit.message != read_message(patch.path).message:
            yield f"commit {commit.hexsha[:12]} has another message than patch {patch.name}"
    for extra in commits[len(patches):]:
        yield f"commit {extra.hexsha[:12]} ({extra.summary}) is not part of the series"


def head(trainer: Path) -> str:
    repo = git.Repo(trainer)
    try:
        return repo.head.commit.hexsha
    finally:
        repo.close()


def expected_state(target: Target, patches: list[Patch], head: str) -> dict:
    """What setup records about a checkout it built or checked: target, commit, HEAD, patch hashes."""
    return {
        "target": target.name,
        "url": target.url,
        "commit": target.commit,
        "head": head,
        "patches": {p.name: p.sha256() for p in patches},
        "overlay": overlay.digest(overlay.trainer_files(target)),
    }


def write_state(state_file: Path, state: dict) -> None:
    replace_own(state_file, json.dumps(state, indent=2) + "\n")



"""Carry a target's series onto a new upstream commit, stopping on conflicts like `git rebase`.

The work happens in a scratch checkout under `<workdir>/rebase/<target>/`; `state.json`
beside it records where the rebase stands, so `--continue`, `--skip` and `--abort` can
pick it up from a new process. Nothing in the repository changes until the rebase is
done and `--write` is given.
"""

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import git

from launcher.errors import LauncherError
from launcher.patching import gitops, overlay, series
from launcher.patching.lock import Target
from launcher.progress import say
from launcher.writer import replace_own, write_new

HUNK = re.compile(r"^@@ .* @@.*$", re.M)


@dataclass
class RebaseState:
    target: str
    onto: str  # full commit hash
    series: list[str]  # patch names, in order
    patches_dir: str  # a copy of the original patch files, immune to edits in patches/
    next: int = 0
    results: dict[str, str] = field(default_factory=dict)  # name -> clean / 3-way / resolved / skipped
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why

    @classmethod
    def load(cls, path: Path) -> "RebaseState":
        return cls(**json.loads(path.read_text(encoding="utf-8")))

    def save(self, path: Path) -> None:
        replace_own(path, json.dumps(asdict(self), indent=2) + "\n")


class Rebase:
    """One rebase in progress: its scratch checkout and its state file."""

    def __init__(self, root: Path, options: str = "") -> None:
        self.root = root
        self.checkout = root / "trainer"
        self.state_file = root / "state.json"
        # the options that name this rebase (--target, --workdir), for the printed commands
        self.options = options

    def command(self, action: str) -> str:
        """The command line that runs `action` (--continue, --skip, ...) on this rebase."""
        return " ".join(filter(None, ["python -m launcher rebase", action, self.options]))

    @property
    def in_progress(self) -> bool:
        return self.state_file.is_file()

    def state(self) -> RebaseState:
        if not self.in_progress:
            raise LauncherError(f"no rebase in progress in {self.root}; start one with `rebase --onto REF`")
        return RebaseState.load(self.state_file)

    def start(self, target: Target, onto: str, url: str | None) -> RebaseState:
        if self.in_progress:
            raise LauncherError(
                f"a rebase of {target.name} is already in progress in {self.root}; "
                "finish it with --continue / --skip, or drop it with --abort"
            )
        patches = series.load_checked(target.series)
        self.root.mkdir(parents=True, exist_ok=True)
        if self.checkout.exists():
            raise LauncherError(f"{self.checkout} exists without a rebase state; remove it or use --abort")
        repo = gitops.clone(url or target.url, self.checkout)
        onto_commit = gitops.fetch_commit(repo, onto)
        gitops.checkout_sparse(repo, onto_commit, "rebase", target.exclude)
        overlay.commit(repo, overlay.trainer_files(target))
        saved = self.root / "original-patches"
        saved.mkdir()
        for patch in patches:
            write_new(saved / patch.name, patch.path.read_bytes())
        state = RebaseState(target.name, onto_commit, [p.name for p in patches], str(saved))
        state.save(self.state_file)
        say(f"rebasing {len(patches)} patches of {target.name} onto {onto_commit[:12]} in {self.checkout}")
        return state

    def advance(self, state: RebaseState) -> bool:
        """Apply patches from `state.next` on; False when one stops on a conflict."""
        repo = git.Repo(self.checkout)
        while state.next < len(state.series):
            name = state.series[state.next]
            patch = Path(state.patches_dir) / name
            result = gitops.apply_patch(repo, patch, allow_3way=True)
            if result.status == "conflict":
                rejects = []
                if not repo.git.diff("--name-only", "--diff-filter=U"):
                    # git could not even start a 3-way merge (the patch's pre-image blobs are
                    # not in this repository, e.g. after an earlier patch to the same file was
                    # resolved by hand) and applied nothing: apply what fits, reject the rest
                    rejects = self._apply_with_rejects(repo, patch, result.files)
                state.save(self.state_file)
                self._report_conflict(name, patch, result, rejects)
                return False
            if not repo.index.diff("HEAD"):
                state.skipped[name] = f"absorbed upstream: applying it onto {state.onto[:12]} changes nothing"
                state.results[name] = "absorbed"
                say(f"  {name}: absorbed upstream (applies as no change), dropped")
            else:
                self._commit(repo, patch)
                state.results[name] = result.status
                say(f"  {name}: applied {'clean' if result.status == 'clean' else 'via 3-way merge'}")
            state.next += 1
            state.save(self.state_file)
        return True

    def resume(self, state: RebaseState) -> None:
        """--continue: commit the user's resolution of the stopped patch."""
        if state.next >= len(state.series):
            return  # every patch is in; --continue (--write) only exports the result
        repo = git.Repo(self.checkout)
        unmerged = repo.git.diff("--name-only", "--diff-filter=U").splitlines()
        rejects = sorted(str(p.relative_to(self.checkout)) for p in self.checkout.rglob("*.rej"))
        if unmerged or rejects:
            raise LauncherError(
                f"still unresolved in {self.checkout}: {', '.join(unmerged + rejects)}. Edit the "
                "files (apply each .rej file's hunks by hand, then delete it), `git add` them, "
                f"then run `{self.command('--continue')}` again"
            )
        name = state.series[state.next]
        self._commit(repo, Path(state.patches_dir) / name)
        state.results[name] = "resolved"
        state.next += 1
        state.save(self.state_file)
        say(f"  {name}: resolved by hand")

    def skip(self, state: RebaseState, reason: str) -> None:
        """--skip: drop the stopped patch (upstream absorbed it) and record why."""
        if state.next >= len(state.series):
            raise LauncherError("every patch is already in; nothing to skip. Use --continue --write or --abort")
        repo = git.Repo(self.checkout)
        repo.git.reset("-q", "--hard", "HEAD")
        for reject in self.checkout.rglob("*.rej"):
            reject.unlink()
        name = state.series[state.next]
        state.skipped[name] = reason
        state.results[name] = "skipped"
        state.next += 1
        state.save(self.state_file)
        say(f"  {name}: dropped ({reason})")

    def abort(self) -> None:
        if not self.root.exists():
            raise LauncherError(f"no rebase in progress in {self.root}")
        gitops.remove_tree(self.root)
        say(f"rebase aborted; removed {self.root}; upstream.lock and patches/ are unchanged")

    def export(self, state: RebaseState, series_file: Path, overlay_dir: Path | None,
               contract_dir: Path | None = None) -> list[series.Patch]:
        """Write the rebased commits as the series, keeping a record of what was dropped."""
        repo = git.Repo(self.checkout)
        patches = series.export_series(repo, state.onto, "HEAD", series_file, overlay_dir, contract_dir)
        kept = series_file.read_text(encoding="utf-8")
        if state.skipped:
            notes = "".join(
                note for name, why in sorted(state.skipped.items())
                if (note := f"# dropped {name}: {why}\n") not in kept
            )
            with series_file.open("a", encoding="utf-8", newline="\n") as handle:
                handle.write(notes)
        return patches

    def _commit(self, repo: git.Repo, patch: Path) -> None:
        info = series.read_message(patch)
        gitops.commit_as(repo, info.message, info.author, info.email, info.date)

    def _apply_with_rejects(self, repo: git.Repo, patch: Path, files: list[str]) -> list[str]:
        """`git apply --reject`: stage the files that applied, leave `<file>.rej` for the rest."""
        try:
            repo.git.apply("--reject", "--whitespace=nowarn", str(patch))
        except git.GitCommandError:
            pass  # exit 1 when hunks were rejected, which is the point
        rejected = [path for path in files if (self.checkout / f"{path}.rej").is_file()]
        applied = [path for path in files if path not in rejected]
        if applied:
            repo.git.add("-A", "--", *applied)
        return rejected

    def _report_conflict(
        self, name: str, patch: Path, result: gitops.ApplyResult, rejects: list[str] | None = None
    ) -> None:
        rejects = rejects or []
        files = rejects or result.files
        say(f"  {name}: CONFLICT in {', '.join(files)}")
        for path, hunks in hunks_by_file(patch.read_text(encoding="utf-8")).items():
            if path in files:
                for header in hunks:
                    say(f"    {path}: {header}")
        if rejects:
            say(
                "  git could not 3-way merge this patch (" + (result.detail.splitlines() or ["?"])[0]
                + "); the hunks that fit are applied and staged, the others are in "
                + ", ".join(f"{path}.rej" for path in rejects)
            )
            how = "apply the hunks of each .rej file by hand, delete the .rej files"
        else:
            how = "edit the files above (look for <<<<<<< markers)"
        say(
            "Resolve it like a git rebase:\n"
            f"  cd {self.checkout}\n"
            f"  # {how}, then:\n"
            f"  git add {' '.join(files)}\n"
            f"  {self.command('--continue')}\n"
            "Or drop the patch if upstream already does what it did:\n"
            f"  {self.command('--skip')} --reason \"absorbed upstream in <commit>\"\n"
            "Or give up, leaving upstream.lock and patches/ untouched:\n"
            f"  {self.command('--abort')}"
        )


def hunks_by_file(patch_text: str) -> dict[str, list[str]]:
    """Hunk headers (`@@ -a,b +c,d @@ context`) of a patch, grouped by the file they change."""
    found: dict[str, list[str]] = {}
    for chunk in re.split(r"^diff --git ", patch_text, flags=re.M)[1:]:
        path = chunk.split("\n", 1)[0].split(" b/", 1)[-1]
        found[path] = HUNK.findall(chunk)
    return found


def write_lock_commit(lock_file: Path, target_name: str, commit: str) -> None:
    """Change one target's `commit:` in upstream.lock, leaving comments and layout alone."""
    lines = lock_file.read_text(encoding="utf-8").splitlines(keepends=True)
    items = [i for i, line in enumerate(lines) if line.lstrip().startswith("- ")]
    if not items:
        raise LauncherError(f"{lock_file} lists no targets")
    indent = _indent(lines[items[0]])  # the targets list; deeper "- " lines are inner lists
    starts = [i for i in items if _indent(lines[i]) == indent] + [len(lines)]
    for start, end in zip(starts, starts[1:]):
        keys = {_key(lines[i]): i for i in range(start, end)}
        name_line = keys.get("name")
        if name_line is None or lines[name_line].split(":", 1)[1].strip() != target_name:
            continue
        if "commit" in keys:
            line = lines[keys["commit"]]
            lines[keys["commit"]] = line[: line.index("commit:")] + f"commit: {commit}\n"
            replace_own(lock_file, "".join(lines))
            return
    raise LauncherError(f"{lock_file} has no `commit:` line for target {target_name}")


def _key(line: str) -> str:
    """The YAML key a lock line sets (`- name: x` and `name: x` both give `name`)."""
    return line.strip().removeprefix("- ").split(":", 1)[0].strip()


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())

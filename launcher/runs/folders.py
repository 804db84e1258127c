"""The layout of a run folder, and finding a run from a name, a path or "the latest".

    <output>/<name>/                 run folder (the trainer's training_folder)
        config.yaml                  the rendered trainer config
        train.log                    everything the trainer printed
        telemetry.jsonl              one row every interval: trainer + GPU figures
        trainer-telemetry.jsonl      rows written inside the trainer (in-process VRAM, wall 10)
        watchdog.jsonl               stall watchdog decisions
        comfyui/                     `comfy`: <LoRA name>.workflow.json (UI) and .api.json (POST /prompt)
        samples/<step>/              `sample`: p<prompt>_s<strength>.png and contact_sheet.png (step or final)
        run.lock, run.lock.json      held while a trainer runs here, and who holds it
        dataset-<n>.json             the images trained on, when bad ones are skipped
        <name>/                      what the trainer writes: LoRA, checkpoints, optimizer state
            run.json                 launcher metadata: lock commit, patch hashes, preset, torch, GPU
            SAVE_NOW / STOP_NOW      flag files the train loop picks up
"""

import re
import time
from dataclasses import dataclass
from pathlib import Path

from flux2_contract.files import CHECKPOINT_MANIFEST, PROFILE_DIR, SAVE_NOW, STOP_NOW, TELEMETRY_FILE
from launcher.errors import LauncherError
from launcher.nofollow import first_link, is_link, refuse_links
from launcher.runs.run_lock import LOCK_FILE
from launcher.runs.schema import RESOLUTION, Anything, Block, Extension, ListOf, Nullable, PlainName, Text, Vocabulary
from launcher.runs.yaml_files import load_yaml

WORKDIR_MARKER = "setup-state.json"
"""The file setup writes at the top of a workdir (Workdir.state_file)."""
WORKDIR_INSTALLS = ("trainer", "trainer.partial", "venv")
"""The folders setup installs into a workdir (Workdir.trainer, its staging copy, Workdir.venv)."""


@dataclass(frozen=True)
class RunFolder:
    root: Path
    name: str

    @classmethod
    def inside(cls, output: Path, name: str, workdir: Path | None = None) -> "RunFolder":
        """`output/name`, refused unless it resolves to a folder directly inside `output` and is no link;
        with `workdir` (the default output, <workdir>/runs), no link between the workdir and it either."""
        if workdir is not None:
            check_runs_folder(workdir, output)
        if output.exists() and not output.is_dir():
            raise LauncherError(f"--output {output} is a file; give a folder (it is created when missing)")
        root = (output / name).resolve()
        if root.parent != output.resolve():
            raise LauncherError(
                f"the run name {name!r} (config.name) would put the run at {root}, not in {output}; "
                "use a plain folder name, and no link in its place"
            )
        if is_link(output / name):  # a link to another folder of `output`: that run's files would be overwritten
            raise run_link_error(output / name)
        if root.exists() and not root.is_dir():
            raise LauncherError(f"{root} is a file; the run folder must be a folder: move it or rename the run")
        installed = _installed_tree(root)
        if installed is not None:
            raise LauncherError(
                f"the run name {name!r} (config.name) with --output {output} would put the run at {root}, "
                f"{'which is' if installed == root else 'inside'} {installed}, the trainer checkout or a venv that setup "
                "installs: the run and setup would overwrite each other; give --output a folder of its own (the default "
                "is <workdir>/runs) or rename the run"
            )
        return cls(root, name)

    @property
    def job_dir(self) -> Path:
        return self.root / self.name

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def log(self) -> Path:
        return self.root / "train.log"

    @property
    def telemetry(self) -> Path:
        return self.root / "telemetry.jsonl"

    @property
    def trainer_telemetry(self) -> Path:
        return self.root / TELEMETRY_FILE

    @property
    def watchdog_events(self) -> Path:
        return self.root / "watchdog.jsonl"

    @property
    def metadata(self) -> Path:
        return self.job_dir / "run.json"

    def dataset_list(self, index: int) -> Path:
        """The images a dataset trains on when bad files are skipped (the trainer's dataset_path)."""
        return self.root / f"dataset-{index}.json"

    def flag(self, name: str) -> Path:
        return self.job_dir / name

    @property
    def comfyui(self) -> Path:
        return self.root / "comfyui"

    @property
    def samples(self) -> Path:
        return self.root / "samples"

    def saved_step(self, lora: Path) -> int | None:
        """The step a saved LoRA was written at; None for the final save."""
        return _saved_step(lora, self.name)

    def longest_files(self, steps: int) -> list[Path]:
        """The longest paths this run will write: the LoRA at its highest step, its ComfyUI workflow
        (`comfy`) and a sample sheet (`sample`)."""
        lora = f"{self.name}_{steps:09d}"
        return [self.job_dir / f"{lora}.safetensors", self.comfyui / f"{lora}.workflow.json",
                self.samples / str(steps) / "contact_sheet.png"]

    def refuse_links(self) -> None:
        """No link in place of the job folder or of a file the launcher or trainer writes here: the
        LoRA, run.json and the logs would land wherever it points, outside --output."""
        for path in (self.job_dir, self.config, self.log, self.telemetry, self.trainer_telemetry,
                     self.watchdog_events, self.comfyui, self.samples, self.root / PROFILE_DIR, self.metadata):
            refuse_links(self.root, path)

    def refuse_job_file(self) -> None:
        """A file where the job folder goes: nothing may be written beside it or into it."""
        if self.job_dir.exists() and not self.job_dir.is_dir():
            raise LauncherError(f"{self.job_dir} is a file where the trainer keeps the run's job folder (its LoRA "
                                "files, run.json): move it aside, or give --output a folder of its own")

    def refuse_foreign(self) -> None:
        """A folder no launch has run in (it has no run.lock, which a launch makes before it writes
        anything) may hold only the job folder that `stop` or `save` make: anything else is the
        user's, and the rendered config and the logs would overwrite it. A link is named as one."""
        self.refuse_links()
        self.refuse_job_file()
        if not self.root.is_dir() or (self.root / LOCK_FILE).exists():
            return
        foreign = sorted(path.name for path in self.root.iterdir() if path.name != self.name)
        if self.job_dir.is_dir():  # `stop` and `save` may have made it, with their flag files only
            foreign += sorted(f"{self.name}/{path.name}" for path in self.job_dir.iterdir()
                              if path.name not in (SAVE_NOW, STOP_NOW))
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise LauncherError(f"{self.root} holds files no launch wrote ({shown}); a run there would overwrite them: "
                                "give --output a folder of its own, or rename the run (config.name)")

    def checkpoints(self) -> list[Path]:
        """What a resume can start from, oldest first: saved LoRA files, and the manifest the
        atomic-save patch commits a checkpoint with (it exists before the files are renamed)."""
        if not self.job_dir.is_dir():
            return []
        found = [*self.job_dir.glob(f"{self.name}*.safetensors"), *self.job_dir.glob(CHECKPOINT_MANIFEST)]
        return sorted(found, key=lambda p: p.stat().st_mtime)

    def saved_lora(self, step: str | None) -> Path:
        """The LoRA file saved at `step` (a number), or the newest one for None / "latest"."""
        saved = [path for path in self.checkpoints() if path.suffix == ".safetensors"]
        if not saved:
            raise LauncherError(
                f"{self.root} has no saved LoRA yet ({self.job_dir} holds no {self.name}*.safetensors): the trainer "
                "saves one every save_every steps and at the end; `python -m launcher save` asks for one now"
            )
        if step in (None, "latest"):
            return saved[-1]
        steps = {_saved_step(path, self.name): path for path in saved}
        if step.isdigit() and int(step) in steps:
            return steps[int(step)]
        listed = ", ".join("final" if number is None else str(number) for number in steps)
        raise LauncherError(f"no LoRA saved at step {step!r} in {self.job_dir}; saved: {listed} (or `latest`)")


def _installed_tree(root: Path) -> Path | None:
    """The trainer checkout or venv that `root` is (or lies inside), or None: a folder named like one
    that setup installs in a folder holding the workdir's state file, or any folder holding a pyvenv.cfg."""
    for folder in (root, *root.parents):
        if (folder / "pyvenv.cfg").is_file():
            return folder
        if folder.name in WORKDIR_INSTALLS and (folder.parent / WORKDIR_MARKER).is_file():
            return folder
    return None


def clear_stale_flags(run: RunFolder) -> list[str]:
    """Remove the SAVE_NOW / STOP_NOW flag files a launch finds in its job folder, and say so.

    Called as a launch starts, before its trainer: every flag already there was written before this
    launch (by `stop` or `save` on a run no trainer was running, or left by a trainer that died before
    acting on it), and would otherwise stop or checkpoint the new trainer at its first step, after
    minutes of loading. A link in a flag's place is removed, never what it points at.
    """
    lines = []
    for flag in (STOP_NOW, SAVE_NOW):
        path = run.flag(flag)
        try:
            written = path.lstat().st_mtime
        except OSError:  # missing, or the job folder does not exist yet
            continue
        refuse_links(run.root, path.parent)
        try:
            path.unlink()
        except OSError as error:
            raise LauncherError(f"cannot remove the stale flag file {path} ({error.strerror or error}); delete it "
                                "by hand, or this launch would act on it at its first step") from None
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(written))
        lines.append(f"removed {path}, written {when}, before this launch: a flag acts only on a trainer that is "
                     f"running (`python -m launcher {flag.split('_')[0].lower()}` while it trains)")
    return lines


def _saved_step(path: Path, name: str) -> int | None:
    """The step in `<name>_000000500.safetensors`; None for the final `<name>.safetensors`."""
    match = re.fullmatch(re.escape(name) + r"_(\d+)", path.stem)
    return int(match.group(1)) if match else None


def check_runs_folder(workdir: Path, runs_dir: Path) -> None:
    """No link between the workdir and its runs folder, as setup refuses one: every run would be
    written wherever it leads."""
    link = first_link(workdir, runs_dir)
    if link is not None:
        raise LauncherError(
            f"{link} leads out of the workdir (to {link.resolve()}); the launcher only writes inside "
            f"{workdir}. Replace the link by a real folder, or give --output the folder it led to")


def run_link_error(path: Path) -> LauncherError:
    return LauncherError(f"the run folder {path} is a link (to {path.resolve()}); the launcher writes into no run "
                         "folder through a link: give the real folder's path, or move the run itself here")


def _found(root: Path) -> "RunFolder":
    if is_link(root):
        raise run_link_error(root)
    return RunFolder(root, _job_name(root))


def find_run(runs_dir: Path, spec: str | None) -> RunFolder:
    """A run folder from a path, a name under `runs_dir`, or the most recent one; never through a link
    at the run folder or at `runs_dir` (the workdir's runs folder)."""
    if spec:
        for candidate in (Path(spec), runs_dir / spec):
            if candidate != Path(spec):
                check_runs_folder(runs_dir.parent, runs_dir)
            if (candidate / "config.yaml").is_file():
                return _found(candidate)
            inside = sorted(p for p in candidate.glob("*") if (p / "config.yaml").is_file()) if candidate.is_dir() else []
            if len(inside) == 1:  # the folder given to `run --output`
                return _found(inside[0])
            if inside:
                raise LauncherError(f"{candidate} holds {len(inside)} runs ({', '.join(p.name for p in inside)}); "
                                    "name one of them")
        raise LauncherError(f"no run {spec!r}: give a run folder or a run name under {runs_dir}")
    check_runs_folder(runs_dir.parent, runs_dir)
    runs = sorted(
        (p for p in runs_dir.glob("*") if (p / "config.yaml").is_file()),
        key=lambda p: (p / "config.yaml").stat().st_mtime,
    )
    if not runs:
        raise LauncherError(f"no runs in {runs_dir}; start one with `python -m launcher run PRESET`")
    return _found(runs[-1])


def read_run_config(root: Path) -> dict:
    """A run folder's rendered config.yaml; a damaged one is a LauncherError naming it."""
    path = root / "config.yaml"
    data = load_yaml(path)
    block = data.get("config") if isinstance(data, dict) else None
    name = block.get("name") if isinstance(block, dict) else None
    if not isinstance(name, str):
        raise LauncherError(f"{path} is not a run config (it lacks config.name); it was "
                            "damaged: restore it from a backup, or write it again by resuming with the run's preset")
    if next(PlainName().check(name, "config.name", None), None) is not None:
        raise LauncherError(
            f"{path}: config.name {name!r} is not {PlainName.allowed}: the run's flag files and outputs would land "
            f"outside {root}; set it back to the name of the folder beside config.yaml that holds the run's LoRA"
        )
    return data


RUN_PROCESS = Block({
    # what `sample` and `comfy` read of a rendered config's first process: a damaged one is named, not a traceback
    "model": Block({"name_or_path": Text()}, extra=Anything(), required=("name_or_path",)),
    "datasets": ListOf(Block({"folder_path": Text(), "caption_ext": Extension()}, extra=Anything(),
                             required=("folder_path",))),
    "sample": Nullable(Block({"width": RESOLUTION, "prompts": ListOf(Anything())}, extra=Anything())),
    "trigger_word": Nullable(Text()),
}, extra=Anything(), required=("model",))


def read_run_process(root: Path) -> tuple[dict, dict]:
    """A run folder's rendered config and its first process, checked for what `sample` and `comfy` read."""
    data = read_run_config(root)
    process = data["config"].get("process")
    found = list(ListOf(RUN_PROCESS, min_items=1).check(process, "config.process", Vocabulary()))
    if found:
        raise LauncherError(f"{root / 'config.yaml'}: {found[0]}; the run config was damaged: restore it from a "
                            "backup, or write it again by resuming with the run's preset")
    return data, process[0]


def _job_name(root: Path) -> str:
    """The trainer's job name, read back from the rendered config."""
    return read_run_config(root)["config"]["name"]

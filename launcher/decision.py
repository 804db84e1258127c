"""What `run` decides for one launch, decided once: `decide` builds a `LaunchDecision` from the
preset, the self-test's verdicts and the machine, and `run` then writes it (config.yaml, the
dataset lists, run.json) and starts the trainer from it; `run --dry-run` prints the same decision.

Each stage is a function that returns its part (the rendered config, its resolution, the dataset
lists, the hand-over, the environment, the ranks), so no stage changes a dict another one made.
The checks of the files a run uses (model folders, datasets, disk) run here too, before the
trainer starts, so no long work is lost; what they and the resolvers have to say is kept, in order,
in the decision's `messages`.
"""

import copy
import os
from dataclasses import dataclass
from pathlib import Path

from flux2_contract.files import PROFILE_DIR, RANK_STATE_FILE
from launcher.envs.probe import probe_with
from launcher.envs.rocm_windows_toolchain import trainer_env as toolchain_env
from launcher.envs.torchenv import NO_BYTECODE, clean_env
from launcher.envs.workdir import Workdir, venv_python
from launcher.resolve import resolve_run
from launcher.runs import disk_budget, files, memory_plan, ranks, tiny, validate
from launcher.runs.dataset import DEFAULT_BUCKET_TOLERANCE, DatasetCheck, check_dataset, long_caption_warnings
from launcher.runs.folders import RunFolder
from launcher.runs.path_limits import check_lengths
from launcher.runs.presets import Preset, render
from launcher.runs.trainer_env import ALLOCATOR_VARIABLES, EXPANDABLE
from launcher.selftest.verdict import Verdicts


@dataclass(frozen=True)
class Message:
    """One line `run` says about its decision: a warning, or a line that a dry run prints as a YAML
    comment where `comment` (its choices and plans; its output stays a config)."""

    text: str
    warning: bool = False
    comment: bool = True


@dataclass(frozen=True)
class SkippedImages:
    """A dataset trained from a list file without its bad images (`launcher: {skip_bad_images: true}`)."""

    process: int
    dataset: int
    listed: Path
    """The trainer's `dataset_path` file, written by `run`."""
    check: DatasetCheck


@dataclass(frozen=True)
class Flags:
    """What the command line asks of one launch, besides the preset."""

    places: dict[str, Path]
    """Model, text encoder, dataset and output folders (`run` flags, else environment variables)."""
    gpus: int | None = None
    profile_steps: int | None = None


@dataclass(frozen=True)
class LaunchDecision:
    """Everything `run` decided for one launch; written as it stands, never changed after."""

    preset: Preset
    run: RunFolder
    config: dict
    """The resolved config, as the run's config.yaml gets it: every `auto` decided, handed over."""
    messages: tuple[Message, ...]
    """What `run` says of its choices, checks and plans, in order."""
    env: dict[str, str]
    """The trainer process's whole environment."""
    shown_env: tuple[str, ...]
    """The variables `run` adds to that environment, which a dry run prints."""
    team: ranks.Ranks
    skipped: tuple[SkippedImages, ...]
    selftest: str
    """The summary of the self-test report this launch read (run.json keeps it)."""

    @property
    def qtypes(self) -> list[str]:
        """The qtypes the config trains with (run.json keeps them)."""
        return sorted({(p.get("model") or {}).get("qtype") for p in self.config["config"]["process"]} - {None})


def decide(preset: Preset, verdicts: Verdicts, workdir: Workdir, flags: Flags,
           python: Path | None = None) -> LaunchDecision:
    """The one decision of a launch, from the preset, the self-test report this launch read, the
    machine (the workdir and what it holds) and the command line: the run folder, the config
    rendered, resolved (launcher/resolve.py), checked against the files it names and handed over
    (launcher/runs/files.py), the trainer's environment and ranks. `python` is the trainer venv's
    interpreter, which builds a tiny preset's model. LauncherError where a check fails; nothing is
    written into the run folder."""
    places = flags.places
    run = RunFolder.inside(places.get("output") or workdir.runs, preset.name,
                           workdir=None if "output" in places else workdir.root)
    check_lengths(run.longest_files(preset.steps))
    run.refuse_foreign()
    manifest = None
    if preset.tiny:
        arch = preset.config["config"]["process"][0]["model"].get("arch")
        manifest = tiny.ensure_for_arch(workdir.assets, arch, workdir.trainer, python)
    rendered = render(preset, run.root, tiny_manifest=manifest, places=model_places(places, preset.tiny))
    resolved = resolve_run(rendered, verdicts, preset.sampling, preset.path)
    checked, skipped = check(preset, resolved.config, workdir, run, full_size=not preset.tiny)
    extra = {**launch_env(workdir), **resolved.env}  # caches, and the libraries' variables of the verdicts
    added = env_changes(preset, workdir, extra)
    env = trainer_env(added)
    team = plan_ranks(flags.gpus or preset.gpus, workdir, env)
    config = files.hand_over(with_dataset_lists(resolved.config, skipped),
                             handed_over(run, preset, flags.profile_steps, team.count), cache_folders(workdir),
                             resolved.launch_plans)
    planned = team.lines + tuple(memory_plan.card_plans(config, team.cards, resolved.planner))
    messages = (*(Message(line) for line in resolved.lines), *checked, *(Message(line) for line in planned))
    return LaunchDecision(preset=preset, run=run, config=config, messages=messages,
                          env={**env, **team.env()}, shown_env=tuple(sorted({**added, **team.env()})), team=team,
                          skipped=tuple(skipped), selftest=verdicts.summary)


def model_places(places: dict[str, Path], tiny: bool) -> dict[str, Path]:
    """The folders the rendered config points at: a tiny preset trains its own tiny model, on
    --dataset when one is given (a quick test of a dataset through the trainer, at the tiny model's
    resolution); model folders do not fit it."""
    return {key: value for key, value in places.items() if key == "dataset"} if tiny else places


def plan_ranks(count: int, workdir: Workdir, env: dict[str, str]) -> ranks.Ranks:
    """The ranks of the run; torch in the trainer venv is asked for its GPUs only for more than one."""
    if count == 1:
        return ranks.Ranks(1, "cpu")
    python = venv_python(workdir.venv)
    info = probe_with(python) if python.is_file() else {"error": f"no trainer venv in {workdir.root}: run setup"}
    return ranks.plan(count, info, env)


def check(preset: Preset, config: dict, workdir: Workdir, run: RunFolder,
          full_size: bool) -> tuple[list[Message], list[SkippedImages]]:
    """Every check of the files a run uses, before the trainer starts, so no long work is lost: what
    it has to say, and each dataset trained from a list file when bad files are skipped."""
    said, skipped = [], []
    for message in validate.network_warnings(config):
        said.append(Message(f"{preset.path}: {message}", warning=True))
    for index, process in enumerate(config["config"]["process"]):
        model = process["model"]
        if full_size:
            # a preset that reshapes the transformer (flux2_params other than FLUX.2 [dev]'s) is not the 64 GB model
            params = (model.get("model_kwargs") or {}).get("flux2_params")
            validate.check_model_dir(Path(model["name_or_path"]), full_size=not validate.reshapes(params),
                                     flux2_params=params, arch=model.get("arch"))
            note = validate.check_text_encoder(model.get("model_kwargs", {}).get("text_encoder_path", ""),
                                               Path(os.environ.get(files.ENV_TEXT_CACHE_DIR) or workdir.text_cache),
                                               arch=model.get("arch"))
            said += [Message(note, comment=False)] if note else []
        for place, dataset in enumerate(process["datasets"]):
            result = check_dataset(Path(dataset["folder_path"]), dataset.get("caption_ext", "txt"),
                                   dataset.get("bucket_tolerance", DEFAULT_BUCKET_TOLERANCE), preset.skip_bad_images)
            said += [Message(message, warning=True) for message in long_caption_warnings(result)]
            if result.bad:
                listed = run.dataset_list(len(skipped))
                said.append(Message(f"skipping {len(result.bad)} of {len(result.bad) + len(result.good)} images in "
                                    f"{result.folder} (launcher.skip_bad_images); they are listed in {run.metadata}",
                                    warning=True))
                skipped.append(SkippedImages(index, place, listed, result))
    if full_size:
        said += disk_lines(config, run, workdir)
    return said, skipped


def disk_lines(config: dict, run: RunFolder, workdir: Workdir) -> list[Message]:
    """Room on each volume for what the run still writes; what already exists is said and not counted."""
    needs = disk_budget.run_needs(config, run.root, quantized_cache_dir(workdir))
    disk_budget.check_free_disk(needs)
    return [Message(f"disk: {need.what}: {need.already}, {need.gib:.1f} GiB still to write", comment=False)
            for need in needs if need.already]


def with_dataset_lists(config: dict, skipped: list[SkippedImages]) -> dict:
    """The config with each dataset that skips images pointed at its list file (`dataset_path`)."""
    config = copy.deepcopy(config)
    for item in skipped:
        config["config"]["process"][item.process]["datasets"][item.dataset]["dataset_path"] = str(item.listed)
    return config


def quantized_cache_dir(workdir: Workdir) -> Path:
    """One quantized-transformer cache per workdir (wall 8), unless AITK_QUANT_CACHE_DIR says otherwise."""
    return Path(os.environ.get(files.ENV_QUANT_CACHE_DIR) or workdir.quantized_cache)


def launch_env(workdir: Workdir) -> dict[str, str]:
    """Triton's kernel and autotuning cache and torch.compile's cache in the workdir (built once,
    reused by every later process)."""
    return {"TRITON_CACHE_DIR": os.environ.get("TRITON_CACHE_DIR") or str(workdir.triton_cache),
            "TRITON_CACHE_AUTOTUNING": "1",
            "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(workdir.inductor_cache)}


def handed_over(run: RunFolder, preset: Preset, profile_steps: int | None, gpus: int) -> dict:
    """The model_kwargs `run` writes for this launch: the telemetry file and interval, the profiler
    (`--profile N`) and, with several GPUs, the file the rank watch reads (launcher/runs/files.py)."""
    written = {"telemetry_file": str(run.trainer_telemetry), "telemetry_interval_s": preset.telemetry["interval_s"],
               "profile_steps": profile_steps or 0, "profile_dir": str(run.root / PROFILE_DIR)}
    return {**written, "rank_state_file": str(run.root / RANK_STATE_FILE)} if gpus > 1 else written


def cache_folders(workdir: Workdir) -> dict:
    """One quantized-transformer cache (wall 8) and one text cache (walls 3-4) per workdir, shared by
    every run (their keys keep other models and encoders apart), unless the preset names its own."""
    return {"quantized_cache_dir": str(quantized_cache_dir(workdir)),
            "text_embedding_cache_dir": os.environ.get(files.ENV_TEXT_CACHE_DIR) or str(workdir.text_cache)}


def env_changes(preset: Preset, workdir: Workdir, extra: dict[str, str] | None = None) -> dict[str, str]:
    """What `run` adds to the trainer's environment: allocator (wall 7), the ROCm toolchain setup
    stored for Windows (CC, ROCM_HOME, PATH, the GPU pick), `extra` (Triton's and Inductor's caches),
    and last the preset's own env. What the trainer itself reads goes in its config (`handed_over`)."""
    changes = {}
    if preset.allocator == "expandable_segments":
        changes.update(dict.fromkeys(ALLOCATOR_VARIABLES, EXPANDABLE))
    return {**changes, **toolchain_env(workdir.venv), **(extra or {}), **preset.env}


def trainer_env(changes: dict[str, str]) -> dict[str, str]:
    """The trainer process's environment: this shell's, cleaned, with `run`'s changes."""
    return {**clean_env(), **changes, "PYTHONUNBUFFERED": "1", **NO_BYTECODE}


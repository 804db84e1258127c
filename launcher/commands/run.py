"""`python -m launcher run PRESET`: validate, render a preset into a run folder, train in the foreground.

The trainer is started directly (`<venv python> -u run.py <config>`, no shell, no detaching) and
its output is copied line by line to the console and to the run's train.log: a detached launch
with redirected output loses the early lines when the child dies, which are the ones that say why.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path

import yaml

from launcher import __version__
from launcher.card_table import renamed, renamed_note
from launcher.envs.probe import probe_with
from launcher.envs.rocm_windows_toolchain import trainer_env as toolchain_env
from launcher.envs.torchenv import NO_BYTECODE, clean_env
from launcher.envs.workdir import DEFAULT_WORKDIR, Workdir, read_state, venv_python
from launcher.errors import LauncherError
from launcher.families import FLUX2_DEV
from launcher.progress import say, warn
from launcher.resolve import resolve_run
from launcher.runs import disk_budget, files, leash, load_report, memory_plan, ranks, resume, tiny, validate
from launcher.runs.dataset import DEFAULT_BUCKET_TOLERANCE, DatasetCheck, check_dataset, long_caption_warnings
from launcher.runs.exit_status import describe, launcher_code
from launcher.runs.folders import RunFolder, clear_stale_flags
from launcher.runs.path_limits import check_lengths
from launcher.runs.presets import Preset, load_preset, render, write_config
from launcher.runs.run_lock import run_folder_lock
from launcher.runs.schema import Vocabulary, short
from launcher.runs.telemetry import TelemetryRecorder
from launcher.runs.trainer_env import ALLOCATOR_VARIABLES, EXPANDABLE
from launcher.runs.vocabulary import read_vocabulary
from launcher.user_files import read_text
from launcher.watchdog.loop import watch_run
from launcher.watchdog.policy import load_config
from launcher.watchdog.rank_watch import STATE_FILE, watch_ranks
from launcher.writer import open_append, replace_own

LOCATIONS = {
    # flag -> (environment variable, what it is)
    "model_dir": ("FLUX2_MODEL_DIR", f"the folder holding {FLUX2_DEV.transformer_file} and ae.safetensors"),
    "text_encoder": ("FLUX2_TEXT_ENCODER", "the Mistral-Small-3.1-24B folder (model + processor)"),
    "dataset": ("FLUX2_DATASET", "the folder of images with caption files"),
    "output": ("FLUX2_OUTPUT", "where run folders go (default: <workdir>/runs)"),
}


EXAMPLES = """examples:
  python -m launcher run tiny                # the embedded tiny FLUX.2, a few steps on any machine
  python -m launcher run 7900xtx_512 --model-dir M --text-encoder T --dataset D --dry-run
  python -m launcher run my-preset.yaml --resume   # continue the run in the output folder
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser("run", help="train with a preset", description=__doc__.splitlines()[0],
                                   epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("preset", help="a preset YAML file, or the name of a shipped preset (e.g. tiny)")
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="default: %(default)s")
    for flag, (variable, meaning) in LOCATIONS.items():
        parser.add_argument(f"--{flag.replace('_', '-')}", dest=flag, type=Path, help=f"{meaning}; or ${variable}")
    parser.add_argument("--dry-run", action="store_true", help="print the rendered config and environment, exit")
    parser.add_argument("--resume", action="store_true", help="continue the run already in the output folder")
    parser.add_argument(resume.ACCEPT_FLAG, dest="accept_changes", action="store_true",
                        help="with --resume: accept a preset that differs from the run's config in settings that "
                             "leave the saved LoRA and optimizer valid (steps, save cadence, lr...); recorded in run.json")
    parser.add_argument("--gpus", type=gpu_count, metavar="N",
                        help="train on N GPUs of this machine, one rank each (torchrun), data-parallel; the batch "
                             "size is per rank (default: the preset's launcher.gpus, 1)")
    parser.add_argument("--profile", type=positive_int, metavar="N",
                        help="profile N training steps (after 2 warm-up steps) with torch.profiler; the Chrome "
                             "trace and a top-20 table go to <run>/profile/")
    parser.set_defaults(handler=handle)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"--profile takes a number of steps (1 or more), not {text!r}")
    return value


def gpu_count(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 64:
        raise argparse.ArgumentTypeError(f"--gpus takes a number of GPUs from 1 to 64, not {text!r}")
    return int(text)


def plan_ranks(count: int, workdir: Workdir, env: dict[str, str]) -> ranks.Ranks:
    """The ranks of the run; torch in the trainer venv is asked for its GPUs only for more than one."""
    if count == 1:
        return ranks.Ranks(1, "cpu")
    python = venv_python(workdir.venv)
    info = probe_with(python) if python.is_file() else {"error": f"no trainer venv in {workdir.root}: run setup"}
    return ranks.plan(count, info, env)


def handle(args) -> int:
    workdir = Workdir(args.workdir.resolve())
    workdir.check_is_folder()
    preset = load_preset(args.preset, trainer_vocabulary(workdir, keep=not args.dry_run))
    if (card := renamed(args.preset)) is not None:
        say(f"# {renamed_note(card)}" if args.dry_run else renamed_note(card))
    places = locations(args)
    run = RunFolder.inside(places.get("output") or workdir.runs, preset.name,
                           workdir=None if "output" in places else workdir.root)
    check_lengths(run.longest_files(preset.steps))
    run.refuse_foreign()
    if preset.tiny:
        arch = preset.config["config"]["process"][0]["model"].get("arch")
        manifest = tiny.ensure_for_arch(workdir.assets, arch, workdir.trainer, checked_python(workdir))
        config = render(preset, run.root, tiny_manifest=manifest, places=tiny_places(places))
    else:
        config = render(preset, run.root, places=places)
    resolved = resolve_run(config, workdir, preset.sampling, preset.path)
    for line in resolved.lines:  # YAML comments in a dry run, whose output stays a config
        say(f"# {line}" if args.dry_run else line)
    datasets = check(preset, config, workdir, run, full_size=not preset.tiny)
    extra = {**launch_env(workdir), **resolved.env}  # caches, and the libraries' variables of the verdicts
    env = trainer_env(preset, run, workdir, extra)
    team = plan_ranks(args.gpus or preset.gpus, workdir, env)
    env.update(team.env())
    files.hand_over(config, handed_over(run, preset, args.profile, team.count), cache_folders(workdir),
                    resolved.launch_plans)
    for line in team.lines + tuple(memory_plan.card_plans(config, team.cards, resolved.planner)):
        say(f"# {line}" if args.dry_run else line)
    if args.dry_run:
        print(yaml.safe_dump(config, sort_keys=False, allow_unicode=True, width=float("inf")), end="", flush=True)
        for name in sorted({**env_changes(preset, run, workdir, extra), **team.env()}):
            print(f"{name}={env[name]}", flush=True)
        return 0
    python = checked_python(workdir)
    with run_folder_lock(run.root):
        run.refuse_links()
        for line in clear_stale_flags(run):
            warn(line)
        changes = check_resume(run, args.resume, config, args.accept_changes)
        write_config(config, run.config)
        write_dataset_lists(datasets)
        say_rank_change(run, team.count)
        write_metadata(run, preset, workdir, python, datasets, config, changes, team.count,
                       selftest=resolved.verdicts.summary)
        say(f"run folder: {run.root}")
        offset = load_report.telemetry_offset(run)
        try:
            with TelemetryRecorder(run, preset.telemetry), stall_watchdog(preset, run, python, env), \
                    watch_ranks(run.root, run.trainer_telemetry, team.count, load_config(preset.watchdog).rank_stall_s):
                code = train(team.command(python, run.config.resolve()), workdir.trainer, run, env)
        finally:
            report_load(run, offset)
    (say if code == 0 else warn)(f"{describe(code)}; log: {run.log}")
    return launcher_code(code)


def report_load(run: RunFolder, offset: int) -> None:
    """This launch's peak host RSS and load-phase times into run.json, and one line here."""
    summary = load_report.record(run, offset)
    if summary:
        say(f"host memory and load: {load_report.describe(summary)} (in {run.metadata})")


def trainer_vocabulary(workdir: Workdir, keep: bool) -> Vocabulary:
    """What the workdir's trainer accepts; `keep` remembers its qtypes in the workdir."""
    python = venv_python(workdir.venv)
    return read_vocabulary(workdir.trainer, python if python.is_file() else None,
                           workdir.qtypes_cache if keep else None, read_state(workdir.state_file).get("head"))


@contextmanager
def stall_watchdog(preset: Preset, run: RunFolder, python: Path, env: dict[str, str]):
    """The stall watchdog for the length of the training, when the preset enables it."""
    if not preset.watchdog.get("enabled"):
        yield
        return
    handle = watch_run(load_config(preset.watchdog), run.root, run.log, python, env)
    say(f"stall watchdog on; decisions in {run.watchdog_events}")
    try:
        yield
    finally:
        handle.stop()


def locations(args) -> dict[str, Path]:
    """Model, text encoder, dataset and output folders from flags, else environment variables."""
    found = {}
    for flag, (variable, _) in LOCATIONS.items():
        value = getattr(args, flag) or os.environ.get(variable)
        if value:
            try:
                found[flag] = Path(value).expanduser().resolve()
            except (RuntimeError, OSError, ValueError) as error:  # ~user unknown, a NUL, a loop of links
                given = f"--{flag.replace('_', '-')} {value}" if getattr(args, flag) else f"${variable}={value}"
                user = str(value).split("/")[0].split("\\")[0]
                why = (f"the home folder of {user} is not known" if isinstance(error, RuntimeError) and user.startswith("~")
                       else f"not a usable path ({error})")
                raise LauncherError(f"{given}: {why}; give {LOCATIONS[flag][1]} as a full path") from None
    for flag, what in (("model_dir", "model folder"), ("dataset", "dataset")):
        if flag in found and found[flag].exists() and not found[flag].is_dir():
            raise LauncherError(f"{what} {found[flag]} is a file, not a folder; pass --{flag.replace('_', '-')} (or "
                                f"${LOCATIONS[flag][0]}) {LOCATIONS[flag][1]}")
    return found


def tiny_places(places: dict[str, Path]) -> dict[str, Path]:
    """The tiny preset trains its own tiny model on --dataset when one is given (a quick test of a
    dataset through the trainer, at the tiny model's resolution); model folders do not fit it."""
    for flag in ("model_dir", "text_encoder"):
        if flag in places:
            warn(f"--{flag.replace('_', '-')} (or ${LOCATIONS[flag][0]}) is not used by the tiny preset: it builds "
                 "its own tiny FLUX.2")
    if "dataset" in places:
        say(f"the tiny preset trains on the dataset {places['dataset']} (at its 128 px resolution)")
    return {key: value for key, value in places.items() if key == "dataset"}


def check(preset: Preset, config: dict, workdir: Workdir, run: RunFolder,
          full_size: bool) -> list[tuple[Path, DatasetCheck]]:
    """Every check of the files a run uses, before the trainer starts, so no long work is lost.

    Returns each dataset's check with the list file it is trained from when bad files are
    skipped (`launcher: {skip_bad_images: true}`); the rendered config then points there."""
    datasets = []
    for message in validate.network_warnings(config):
        warn(f"{preset.path}: {message}")
    for process in config["config"]["process"]:
        model = process["model"]
        if full_size:
            # a preset that reshapes the transformer (flux2_params other than FLUX.2 [dev]'s) is not the 64 GB model
            params = (model.get("model_kwargs") or {}).get("flux2_params")
            validate.check_model_dir(Path(model["name_or_path"]), full_size=not validate.reshapes(params),
                                     flux2_params=params, arch=model.get("arch"))
            validate.check_text_encoder(model.get("model_kwargs", {}).get("text_encoder_path", ""),
                                        Path(os.environ.get(files.ENV_TEXT_CACHE_DIR) or workdir.text_cache),
                                        arch=model.get("arch"))
        for dataset in process["datasets"]:
            result = check_dataset(Path(dataset["folder_path"]), dataset.get("caption_ext", "txt"),
                                   dataset.get("bucket_tolerance", DEFAULT_BUCKET_TOLERANCE), preset.skip_bad_images)
            for message in long_caption_warnings(result):
                warn(message)
            if result.bad:
                listed = run.dataset_list(len(datasets))
                dataset["dataset_path"] = str(listed)
                warn(f"skipping {len(result.bad)} of {len(result.bad) + len(result.good)} images in "
                     f"{result.folder} (launcher.skip_bad_images); they are listed in {run.metadata}")
                datasets.append((listed, result))
    if full_size:
        check_disk(config, run, workdir)
    return datasets


def check_disk(config: dict, run: RunFolder, workdir: Workdir) -> None:
    """Room on each volume for what the run still writes; what already exists is said and not counted."""
    needs = disk_budget.run_needs(config, run.root, quantized_cache_dir(workdir))
    for need in needs:
        if need.already:
            say(f"disk: {need.what}: {need.already}, {need.gib:.1f} GiB still to write")
    disk_budget.check_free_disk(needs)


def quantized_cache_dir(workdir: Workdir) -> Path:
    """One quantized-transformer cache per workdir (wall 8), unless AITK_QUANT_CACHE_DIR says otherwise."""
    return Path(os.environ.get(files.ENV_QUANT_CACHE_DIR) or workdir.quantized_cache)


def write_dataset_lists(datasets: list[tuple[Path, DatasetCheck]]) -> None:
    """The trainer's `dataset_path` files: a JSON object keyed by the images to train on."""
    for listed, result in datasets:
        replace_own(listed, json.dumps({str(image): {} for image in result.good}, indent=1) + "\n")


def check_resume(run: RunFolder, asked: bool, config: dict, accept_changes: bool) -> list[dict]:
    """A run folder with checkpoints is continued only on request, and only with the config it was
    trained with (launcher/runs/resume.py); a new run never overwrites it. Returns accepted changes."""
    saved = run.checkpoints()
    if saved and not asked:
        raise LauncherError(
            f"{run.root} already holds a run (latest checkpoint {saved[-1].name}). Continue it with "
            "--resume, or start a new one with another --output"
        )
    if asked and not saved:
        raise LauncherError(f"nothing to resume in {run.root}: no checkpoint there yet")
    if not asked:
        return []
    changes = resume.check_changes(run.config, config, accept_changes)
    for change in changes:
        say(f"resume with a changed setting: {change['key']}: was {short(change['was'])}, now {short(change['now'])}")
    say(f"resuming from {saved[-1].name}")
    return changes


def checked_python(workdir: Workdir) -> Path:
    """The venv interpreter, after checking that setup has produced a trainer and a venv."""
    python = venv_python(workdir.venv)
    if not (workdir.trainer / "run.py").is_file() or not python.is_file():
        raise LauncherError(
            f"{workdir.root} has no trainer checkout or venv: run `python -m launcher setup` first"
        )
    return python


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
               "profile_steps": profile_steps or 0, "profile_dir": str(run.root / files.PROFILE_DIR)}
    return {**written, "rank_state_file": str(run.root / STATE_FILE)} if gpus > 1 else written


def cache_folders(workdir: Workdir) -> dict:
    """One quantized-transformer cache (wall 8) and one text cache (walls 3-4) per workdir, shared by
    every run (their keys keep other models and encoders apart), unless the preset names its own."""
    return {"quantized_cache_dir": str(quantized_cache_dir(workdir)),
            "text_embedding_cache_dir": os.environ.get(files.ENV_TEXT_CACHE_DIR) or str(workdir.text_cache)}


def env_changes(preset: Preset, run: RunFolder, workdir: Workdir, extra: dict[str, str] | None = None) -> dict[str, str]:
    """What `run` adds to the trainer's environment: allocator (wall 7), the ROCm toolchain setup
    stored for Windows (CC, ROCM_HOME, PATH, the GPU pick), `extra` (Triton's and Inductor's caches),
    and last the preset's own env. What the trainer itself reads goes in its config (`handed_over`)."""
    changes = {}
    if preset.allocator == "expandable_segments":
        changes.update(dict.fromkeys(ALLOCATOR_VARIABLES, EXPANDABLE))
    return {**changes, **toolchain_env(workdir.venv), **(extra or {}), **preset.env}


def trainer_env(preset: Preset, run: RunFolder, workdir: Workdir, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**clean_env(), **env_changes(preset, run, workdir, extra), "PYTHONUNBUFFERED": "1", **NO_BYTECODE}


def say_rank_change(run: RunFolder, count: int) -> None:
    """A resume on another number of GPUs goes on from the same LoRA and optimizer state (every rank
    holds the same); the global batch, and so the samples per step, change with it: said once."""
    try:
        before = json.loads(read_text(run.metadata, "metadata")).get("gpus", 1)
    except (LauncherError, ValueError, AttributeError):
        return
    if run.checkpoints() and isinstance(before, int) and before != count:
        say(f"resume on {count} GPU(s), the run trained on {before}: the global batch is now {count} x the preset's "
            "batch_size (the steps left and the lr stay as they are)")


def write_metadata(run: RunFolder, preset: Preset, workdir: Workdir, python: Path,
                   datasets: list[tuple[Path, DatasetCheck]], config: dict, changes: list[dict],
                   gpus: int = 1, *, selftest: str) -> None:
    """run.json beside the LoRA: enough to reproduce the run and to file a bug report; the settings
    each resume changed (`--accept-changes`) are kept from launch to launch. `selftest`: the summary
    of the self-test report this launch read."""
    state = read_state(workdir.state_file)
    resumes = previous_resume_changes(run)
    if changes:
        resumes.append({"at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "changes": changes})
    metadata = {
        "launcher": __version__,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "target": state.get("target"),
        "commit": state.get("commit"),
        "patches": state.get("patches"),
        "preset": str(preset.path),
        "preset_inherits": [str(file) for file in preset.files[1:]],
        "preset_sha256": preset.sha256,
        "torch": probe_with(python),
        "skipped_images": [item for _, result in datasets for item in result.skipped()],
        "qtype": sorted({(p.get("model") or {}).get("qtype") for p in config["config"]["process"]} - {None}),
        "selftest": selftest,
        "gpus": gpus,
        **({"resume_changes": resumes} if resumes else {}),
    }
    replace_own(run.metadata, json.dumps(metadata, indent=2) + "\n")


def previous_resume_changes(run: RunFolder) -> list:
    try:
        earlier = json.loads(read_text(run.metadata, "metadata")).get("resume_changes")
    except (LauncherError, ValueError, AttributeError):  # missing, not a plain file, damaged: none kept
        return []
    return earlier if isinstance(earlier, list) else []


def train(command: list[str], trainer: Path, run: RunFolder, env: dict[str, str]) -> int:
    """Run the trainer (or torchrun and its ranks) in the foreground, teeing its output to the log;
    return its exit code. The trainer dies with the launcher (launcher/runs/leash.py), so it never
    outlives the run lock; a rank that ends early is named in one line."""
    say(f"training: {' '.join(command)}")
    tail = deque(maxlen=400)
    with open_append(run.root, run.log) as log_file:
        child = subprocess.Popen(command, cwd=trainer, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 **leash.popen_options())
        job = leash.bind(child)
        try:
            for line in iter(child.stdout.readline, b""):
                sys.stdout.buffer.write(line)
                sys.stdout.buffer.flush()
                log_file.write(line)
                log_file.flush()
                tail.append(line.decode("utf-8", "replace"))
        finally:
            code = child.wait()
            leash.release(job)
    failure = ranks.first_failure("".join(tail)) if code else None
    if failure:
        warn(failure)
    return code

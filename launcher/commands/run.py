"""`python -m launcher run PRESET`: validate, render a preset into a run folder, train in the foreground.

The trainer is started directly (`<venv python> -u run.py <config>`, no shell, no detaching) and
its output is copied line by line to the console and to the run's train.log: a detached launch
with redirected output loses the early lines when the child dies, which are the ones that say why.
What a launch runs with is decided once, before anything is written (launcher/decision.py); the
handler prints that decision, or writes it and starts the trainer from it.
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

from flux2_contract.families import FLUX2_DEV
from launcher import __version__
from launcher.card_table import renamed, renamed_note
from launcher.decision import Flags, LaunchDecision, Message, SkippedImages, decide
from launcher.envs.probe import probe_with
from launcher.envs.workdir import DEFAULT_WORKDIR, Workdir, read_state, venv_python
from launcher.errors import LauncherError
from launcher.progress import say, warn
from launcher.runs import leash, load_report, ranks, resume
from launcher.runs.exit_status import describe, launcher_code
from launcher.runs.folders import RunFolder, clear_stale_flags
from launcher.runs.presets import Preset, load_preset, write_config
from launcher.runs.run_lock import run_folder_lock
from launcher.runs.schema import Vocabulary, short
from launcher.runs.telemetry import TelemetryRecorder
from launcher.runs.vocabulary import read_vocabulary
from launcher.selftest.verdict import Verdicts
from launcher.user_files import read_text
from launcher.watchdog.loop import watch_run
from launcher.watchdog.policy import load_config
from launcher.watchdog.rank_watch import watch_ranks
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


def handle(args) -> int:
    workdir = Workdir(args.workdir.resolve())
    workdir.check_is_folder()
    preset = load_preset(args.preset, trainer_vocabulary(workdir, keep=not args.dry_run))
    if (card := renamed(args.preset)) is not None:
        say(f"# {renamed_note(card)}" if args.dry_run else renamed_note(card))
    places = locations(args)
    if preset.tiny:
        say_tiny_places(places)
    flags = Flags(places, args.gpus, args.profile)
    decision = decide(preset, Verdicts.read(workdir), workdir, flags, checked_python(workdir) if preset.tiny else None)
    for message in decision.messages:
        tell(message, args.dry_run)
    if args.dry_run:
        print_decision(decision)
        return 0
    return launch(decision, workdir, args.resume, args.accept_changes)


def print_decision(decision: LaunchDecision) -> None:
    """A dry run's output: the config as the run folder would get it, then the variables `run` sets."""
    print(yaml.safe_dump(decision.config, sort_keys=False, allow_unicode=True, width=float("inf")), end="", flush=True)
    for name in decision.shown_env:
        print(f"{name}={decision.env[name]}", flush=True)


def tell(message: Message, dry_run: bool) -> None:
    """One line of the decision, as a warning or said (a YAML comment in a dry run where it is one)."""
    if message.warning:
        warn(message.text)
    else:
        say(f"# {message.text}" if dry_run and message.comment else message.text)


def launch(decision: LaunchDecision, workdir: Workdir, resume_asked: bool, accept_changes: bool) -> int:
    """Write the decision into its run folder (config.yaml, the dataset lists, run.json) and train
    in the foreground under the run lock; the launcher's exit code."""
    run, preset, team, env = decision.run, decision.preset, decision.team, decision.env
    python = checked_python(workdir)
    with run_folder_lock(run.root):
        run.refuse_links()
        for line in clear_stale_flags(run):
            warn(line)
        changes = check_resume(run, resume_asked, decision.config, accept_changes)
        write_config(decision.config, run.config)
        write_dataset_lists(decision.skipped)
        say_rank_change(run, team.count)
        write_metadata(decision, workdir, python, changes)
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


def say_tiny_places(places: dict[str, Path]) -> None:
    """The tiny preset trains its own tiny model, on --dataset when one is given (launcher/decision.py
    `model_places`): said once, with a warning for each model folder it does not use."""
    for flag in ("model_dir", "text_encoder"):
        if flag in places:
            warn(f"--{flag.replace('_', '-')} (or ${LOCATIONS[flag][0]}) is not used by the tiny preset: it builds "
                 "its own tiny FLUX.2")
    if "dataset" in places:
        say(f"the tiny preset trains on the dataset {places['dataset']} (at its 128 px resolution)")


def write_dataset_lists(skipped: tuple[SkippedImages, ...]) -> None:
    """The trainer's `dataset_path` files: a JSON object keyed by the images to train on."""
    for item in skipped:
        replace_own(item.listed, json.dumps({str(image): {} for image in item.check.good}, indent=1) + "\n")


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


def write_metadata(decision: LaunchDecision, workdir: Workdir, python: Path, changes: list[dict]) -> None:
    """run.json beside the LoRA: enough to reproduce the run and to file a bug report; the settings
    each resume changed (`--accept-changes`) are kept from launch to launch, with the summary of the
    self-test report this launch read."""
    run, preset = decision.run, decision.preset
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
        "skipped_images": [image for item in decision.skipped for image in item.check.skipped()],
        "qtype": decision.qtypes,
        "selftest": decision.selftest,
        "gpus": decision.team.count,
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

"""Patch "atomic checkpoint saves": kill -9 the real trainer in the middle of saves, then resume.

One tiny run (a save every step) is launched again and again with `python -m launcher run`,
and each time the trainer is SIGKILLed at another point of a save: LoRA written; LoRA and
optimizer state written, manifest being written; manifest committed; half the files renamed;
and once at a random moment. To hit those points rather than hope for them, the trainer's
python runs under `strace --inject=...:delay_enter`, which holds every fsync and rename for a
moment; the test watches the save folder and kills when it shows the wanted point.

After every kill the folder must hold one whole checkpoint (or none before the first commit):
the LoRA's training_info step, the optimizer's step count and the manifest agree. The next
launch must resume at exactly that step, and the last launch trains to the end: AdamW's step
count then equals the number of steps, so no step was lost or trained twice across 5 kills.
"""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_run import REPO, run_command, tiny_preset

from flux2_contract.files import CHECKPOINT_MANIFEST as MANIFEST
from launcher.envs.torchenv import clean_env
from launcher.envs.workdir import Workdir, venv_python
from launcher.runs.folders import RunFolder

NAME = "atomic_tiny"
STEPS = 9
TEMP = re.compile(r"^\.(?P<root>.+)\.(?P<token>[0-9a-f]{12})\.aitk-tmp(?P<ext>\.[^.]*)$")
DELAY_US = 500_000
LAUNCH_TIMEOUT_S = 300
# the trainer's python, optionally under strace holding each fsync/rename for DELAY_US
WRAPPER = """#!/bin/sh
[ -n "$AITK_TEST_PIDFILE" ] && echo $$ > "$AITK_TEST_PIDFILE"
if [ -n "$AITK_TEST_DELAY_US" ]; then
  exec strace -f -qq --seccomp-bpf -o /dev/null -e trace={calls} \\
    -e inject={calls}:delay_enter=$AITK_TEST_DELAY_US {python} "$@"
fi
exec {python} "$@"
"""
SYSCALLS = "fsync,rename,renameat,renameat2"
CHECK_SETS = """
import json, sys, torch
from safetensors import safe_open
for lora, optimizer in zip(sys.argv[1::2], sys.argv[2::2]):
    with safe_open(lora, "pt") as f:
        info = json.loads(f.metadata()["training_info"])
        tensors = len(list(f.keys()))
    state = torch.load(optimizer, weights_only=True)
    print(json.dumps({"lora_step": info["step"], "tensors": tensors,
                      "optimizer_steps": sorted({int(v["step"]) for v in state["state"].values()})}))
"""

pytestmark = [pytest.mark.trainer,
              pytest.mark.skipif(sys.platform == "win32", reason="kill -9 and strace are POSIX tools")]


@pytest.fixture(scope="module")
def kill_workdir(trainer_workdir, tmp_path_factory) -> Workdir:
    """A workdir sharing the real trainer and tiny assets, whose venv python is WRAPPER."""
    if shutil.which("strace") is None:
        pytest.skip("needs strace (apt install strace) to stop the trainer at exact points of a save")
    root = tmp_path_factory.mktemp("atomic-wd")
    (root / "trainer").symlink_to(trainer_workdir.trainer.resolve())
    trainer_workdir.assets.mkdir(parents=True, exist_ok=True)
    (root / "assets").symlink_to(trainer_workdir.assets.resolve())
    python = venv_python(root / "venv")
    python.parent.mkdir(parents=True)
    real = os.path.abspath(venv_python(trainer_workdir.venv))
    python.write_text(WRAPPER.format(calls=SYSCALLS, python=real), encoding="utf-8")
    python.chmod(0o755)
    probe = subprocess.run(["strace", "-f", "-qq", "--seccomp-bpf", "-o", "/dev/null", "-e", "inject=fsync:delay_enter=1", "true"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"strace cannot trace here ({probe.stderr.strip()[-200:]})")
    return Workdir(root)


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def save_state(job_dir: Path) -> str | None:
    """Where the save in progress is, from the file names and the manifest; None between saves."""
    try:
        names = os.listdir(job_dir)
        manifest = json.loads((job_dir / MANIFEST).read_text(encoding="utf-8")) if MANIFEST in names else None
    except (OSError, ValueError):
        return None
    committed = set()
    if manifest:
        committed = {TEMP.match(entry["staged"]).group("token") for entry in manifest["files"].values()}
    staged = {}
    for name in names:
        match = TEMP.match(name)
        if match:
            staged.setdefault(match.group("token"), set()).add(match.group("root") + match.group("ext"))
    for token, files in staged.items():
        lora = any(f.startswith(NAME) for f in files)
        optimizer = "optimizer.pt" in files
        if token in committed:
            return "committed" if lora and optimizer else "half_published" if optimizer else None
        if "checkpoint.json" in files:
            return "manifest_staged"
        if lora and optimizer:
            return "optimizer_staged"
        if lora:
            return "lora_staged"
    return None


def committed_set(job_dir: Path) -> dict | None:
    """The checkpoint a resume will take, read without changing anything: each file of the
    manifest under its final name, or under its staged name when the renames were cut short."""
    if not (job_dir / MANIFEST).is_file():
        return None
    manifest = json.loads((job_dir / MANIFEST).read_text(encoding="utf-8"))
    paths = {}
    for role, entry in manifest["files"].items():
        staged, final = job_dir / entry["staged"], job_dir / entry["name"]
        paths[role] = staged if staged.is_file() else final
        assert paths[role].is_file(), f"{MANIFEST} names {entry['name']}, which is gone"
        assert paths[role].stat().st_size == entry["size"], f"{paths[role].name} has the wrong size"
    return {"step": manifest["step"], **paths}


def keep_set(found: dict, into: Path) -> dict:
    """Copy a checkpoint's files aside (the next launch renames and prunes them)."""
    into.mkdir(parents=True)
    return {"step": found["step"], **{role: Path(shutil.copy2(found[role], into / found[role].name))
                                      for role in ("network", "optimizer")}}


def check_sets(workdir: Workdir, sets: list[dict]) -> None:
    """Each kept LoRA and optimizer state loads, and both belong to their manifest's step."""
    paths = [str(p) for found in sets for p in (found["network"], found["optimizer"])]
    result = subprocess.run(
        [os.path.abspath(venv_python(workdir.venv)), "-c", CHECK_SETS, *paths],
        capture_output=True, text=True, env=clean_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for found, line in zip(sets, result.stdout.strip().splitlines()[-len(sets):]):
        loaded = json.loads(line)
        assert loaded["tensors"] > 0, loaded
        assert loaded["lora_step"] == found["step"], (loaded, found)
        assert loaded["optimizer_steps"] == [found["step"]], (loaded, found)


def launch(kill_workdir: Workdir, output: Path, tmp: Path, index: int, kill_at: str | None, delay: bool) -> tuple[int, str]:
    """One `launcher run`; SIGKILL the trainer at `kill_at` (a save_state, or "random").

    Returns the launcher's exit code and output."""
    pidfile = tmp / f"pid-{index}"
    env = {"AITK_TEST_PIDFILE": str(pidfile)}
    if delay:
        env["AITK_TEST_DELAY_US"] = str(DELAY_US)
    preset = tiny_preset(tmp / f"preset-{index}.yaml", name=NAME, steps=STEPS, env=env,
                         save={"save_every": 1, "max_step_saves_to_keep": 2})
    job_dir = output / NAME / NAME
    resume = bool(RunFolder(output / NAME, NAME).checkpoints())  # the launcher's rule for --resume
    log_path = tmp / f"launch-{index}.log"
    command = run_command(kill_workdir.root, preset, output, *(["--resume"] if resume else []))
    with log_path.open("wb") as log:
        launcher = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        random_at = None
        try:
            while kill_at and launcher.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
                if not pidfile.is_file():
                    continue
                if kill_at == "random":
                    if random_at is None and b"Saving at step" in log_path.read_bytes():
                        random_at = time.monotonic() + random.uniform(0.0, 2.0)
                    hit = random_at is not None and time.monotonic() >= random_at
                else:
                    hit = save_state(job_dir) == kill_at
                if hit:
                    pid = int(pidfile.read_text())
                    victims = children(pid) if delay else [pid]
                    for victim in victims:
                        os.kill(victim, signal.SIGKILL)
                    break
            launcher.wait(timeout=max(1, deadline - time.monotonic()))
        finally:
            if launcher.poll() is None:
                launcher.kill()
    text = log_path.read_text(encoding="utf-8", errors="replace")
    if kill_at and kill_at != "random":
        assert save_state(job_dir) == kill_at, f"the trainer was not stopped at {kill_at}:\n{text[-3000:]}"
    return launcher.returncode, text


def resumed_step(text: str) -> int | None:
    found = re.findall(r"Found step (\d+) in metadata", text)
    return int(found[-1]) if found else None


def test_kill_9_during_saves_always_leaves_a_resumable_checkpoint(kill_workdir, tmp_path):
    output = tmp_path / "runs"
    job_dir = output / NAME / NAME
    plan = [
        ("lora_staged", True),       # first save: nothing committed yet, a fresh start follows
        ("committed", True),         # manifest replaced, no file renamed: resume rolls forward
        ("manifest_staged", True),   # both files written, manifest not committed: the previous set stays
        ("half_published", True),    # LoRA renamed, optimizer not yet: resume finishes it
        ("random", False),           # a random moment, no strace
        (None, False),               # to the end
    ]
    expected = None
    sets = []
    started = time.monotonic()
    for index, (kill_at, delay) in enumerate(plan):
        began = time.monotonic()
        code, text = launch(kill_workdir, output, tmp_path, index, kill_at, delay)
        print(f"launch {index} (kill at {kill_at}): {time.monotonic() - began:.0f} s")
        assert resumed_step(text) == expected, f"launch {index} should resume at step {expected}:\n{text[-3000:]}"
        if expected is not None:
            assert "Loading optimizer state from" in text and "Failed to load optimizer state" not in text, text[-3000:]
        found = committed_set(job_dir)
        if kill_at == "lora_staged":
            assert found is None, "a first save killed before its commit must leave no checkpoint"
        else:
            assert found is not None, f"no checkpoint after the kill at {kill_at}"
            sets.append(keep_set(found, tmp_path / f"set-{index}"))
            if kill_at in ("committed", "half_published"):
                assert found["step"] > (expected or 0), "the committed save is the one resumed"
            elif kill_at == "manifest_staged":
                assert found["step"] == expected, "an uncommitted save must leave the previous checkpoint"
            expected = found["step"]
    # the last launch ran to the end
    assert code == 0, text[-3000:]
    assert expected == STEPS, f"the final checkpoint is at step {expected}, not {STEPS}"
    assert committed_set(job_dir)["network"].name == f"{NAME}.safetensors"
    assert not [p for p in os.listdir(job_dir) if TEMP.match(p)], "temporary files left behind"
    check_sets(kill_workdir, sets)
    print(f"{len(plan)} launches in {time.monotonic() - started:.0f} s")

"""The flag-file patch: SAVE_NOW / STOP_NOW flag files in the train loop, and exact resume.

The tiny preset, made 4 steps long with a periodic save every 3, gets STOP_NOW in its folder as
soon as the launch has started (a flag written before the launch is stale and cleared): it saves
a checkpoint after step 1 and exits 0. `run --resume` with SAVE_NOW written the same way then
continues at step 1 with the saved optimizer state, saves at step 2 on the
flag, makes its periodic save after the step numbered 3 and finishes. Exact resume shows in
the optimizer state, AdamW's step count: 1 after the stop and 4 at the end (5 would mean a step
trained twice, 3 that the state was lost), and in the step each checkpoint tells a resume to
start at.
"""

import json
import struct
import subprocess
from pathlib import Path

import pytest
from tiny_run import RUN_NAME as NAME
from tiny_run import REPO, run_command, tiny_preset

from launcher.envs.torchenv import clean_env
from launcher.envs.workdir import venv_python

pytestmark = pytest.mark.trainer
OPTIMIZER_STEP = "import sys, torch; s = torch.load(sys.argv[1]); print(max(int(v['step']) for v in s['state'].values()))"


def launch(workdir, preset: Path, output: Path, flag: Path, *extra: str) -> tuple[int, str]:
    """Run the preset; write `flag` once the launch has started (its run folder is locked and
    stale flags cleared), long before the trainer's first step ends."""
    process = subprocess.Popen(run_command(workdir.root, preset, output, *extra), cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, errors="replace")
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith("run folder:"):
            flag.touch()
    return process.wait(), "".join(lines)


def training_info(path: Path) -> dict:
    """The trainer's training_info metadata of a .safetensors file, read with the standard library."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return json.loads(header["__metadata__"]["training_info"])


def optimizer_step(workdir, job_dir: Path) -> int | None:
    if not (job_dir / "optimizer.pt").is_file():
        return None
    result = subprocess.run(
        [str(venv_python(workdir.venv)), "-c", OPTIMIZER_STEP, str(job_dir / "optimizer.pt")],
        capture_output=True, text=True, env=clean_env(),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return int(result.stdout.strip())


def checkpoint(job_dir: Path, step: int | None = None) -> Path:
    return job_dir / (f"{NAME}_{step:09d}.safetensors" if step is not None else f"{NAME}.safetensors")


@pytest.fixture(scope="module")
def runs(trainer_workdir, tmp_path_factory):
    """Launch, stopped by STOP_NOW; then resume with SAVE_NOW. Returns what each left behind."""
    folder = tmp_path_factory.mktemp("flag-runs")
    # 4 steps, a periodic save every 3, and every checkpoint kept
    preset = tiny_preset(folder / "tiny_flags.yaml", steps=4, save={"save_every": 3, "max_step_saves_to_keep": 10})
    job_dir = folder / NAME / NAME
    job_dir.mkdir(parents=True)
    (job_dir / "SAVE_NOW").touch()  # stale: written before the launch, which must clear it
    first = launch(trainer_workdir, preset, folder, job_dir / "STOP_NOW")
    after_stop = {
        "files": sorted(p.name for p in job_dir.iterdir()),
        "optimizer_step": optimizer_step(trainer_workdir, job_dir),
    }
    second = launch(trainer_workdir, preset, folder, job_dir / "SAVE_NOW", "--resume")
    after_resume = {"optimizer_step": optimizer_step(trainer_workdir, job_dir)}
    return job_dir, first, after_stop, second, after_resume


def test_stop_now_saves_and_exits_zero(runs):
    job_dir, (code, log), after_stop, _, _ = runs
    assert code == 0, log[-4000:]
    assert "STOP_NOW: saved checkpoint at step 1, stopping" in log, log[-4000:]
    assert f"removed {job_dir / 'SAVE_NOW'}" in log and "before this launch" in log
    assert "STOP_NOW" not in after_stop["files"], after_stop["files"]
    assert checkpoint(job_dir, 1).name in after_stop["files"], after_stop["files"]
    assert checkpoint(job_dir).name not in after_stop["files"], "a stopped run must not write the final LoRA"
    assert training_info(checkpoint(job_dir, 1))["step"] == 1
    assert after_stop["optimizer_step"] == 1


def test_resume_continues_at_the_saved_step_with_the_optimizer_state(runs):
    _, _, _, (code, log), after_resume = runs
    assert code == 0, log[-4000:]
    assert "Found step 1 in metadata, starting from there" in log, log[-4000:]
    assert "Loading optimizer state from" in log and "Failed to load optimizer state" not in log, log[-4000:]
    assert after_resume["optimizer_step"] == 4, "one optimizer update per step over the stop and resume"


def test_save_now_saves_and_continues(runs):
    job_dir, _, _, (code, log), _ = runs
    assert "SAVE_NOW: saved checkpoint at step 2" in log, log[-4000:]
    assert not (job_dir / "SAVE_NOW").exists()
    assert training_info(checkpoint(job_dir, 2))["step"] == 2
    assert training_info(checkpoint(job_dir))["step"] == 4


def test_periodic_checkpoint_resumes_after_its_step(runs):
    """The fork names a periodic save after the step just trained; a resume must not train it again."""
    job_dir, _, _, (code, log), _ = runs
    assert "Saving at step 3" in log, log[-4000:]
    assert training_info(checkpoint(job_dir, 3))["step"] == 4

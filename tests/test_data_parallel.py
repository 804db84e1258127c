"""`run --gpus N`: ranks through torchrun, data-parallel LoRA training (launcher/runs/ranks.py,
overlay toolkit/data_parallel.py and the train-loop patches that call it).

The fast tests check the refusals, the command and the failure line. The trainer tests run the
tiny model on the CPU: two gloo ranks of batch 1 against one process of batch 2 on a two-image
dataset (every step sees both images, so the data order cannot differ), with per-image noise
(force_consistent_noise), one fixed timestep, and Adagrad with a large initial accumulator, whose
step is nearly lr x gradient: Adam's first steps are lr x sign(gradient), which turns rounding
differences of near-zero gradients into whole steps and would hide what is compared; these two
run on upstream-main. Then, on amd-fork, STOP_NOW on a two-rank run, its resume on one GPU, and
a rank killed mid-run.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tiny_run import REPO, RUN_NAME, run_command, run_tiny, tiny_preset

from flux2_contract.files import RANK_STATE_FILE
from launcher.envs.torchenv import clean_env
from launcher.envs.workdir import venv_python
from launcher.errors import LauncherError
from launcher.runs import memory_plan, ranks, tiny
from launcher.user_files import load_json_state
from launcher.watchdog import rank_watch

CARD = {"name": "RTX 4090", "vram_total_gib": 23.6}
TOLERANCE = 1e-4
"""Largest relative difference (Frobenius) of any LoRA tensor between the 2 x 1 and the 1 x 2 run;
measured: about 1e-7 (float32 sums in another order)."""


def test_windows_is_refused_in_one_line_before_anything_starts():
    with pytest.raises(LauncherError) as refused:
        ranks.plan(2, {"gpus": [CARD, CARD], "hip": "7.1"}, {}, platform="win32")
    assert "\n" not in str(refused.value) and "RCCL" in str(refused.value) and "--gpus 1" in str(refused.value)


@pytest.mark.parametrize("env, seen", [({}, 2), ({"CUDA_VISIBLE_DEVICES": "1"}, 1),
                                       ({"HIP_VISIBLE_DEVICES": "0,1", "CUDA_VISIBLE_DEVICES": ""}, 0)])
def test_more_gpus_than_visible_are_refused(env, seen):
    with pytest.raises(LauncherError, match=f"only {seen} GPU"):
        ranks.plan(3, {"gpus": [CARD, CARD]}, env, platform="linux")


def test_backend_per_platform_and_cards_that_differ():
    assert ranks.plan(2, {"gpus": [CARD, CARD]}, {}, platform="linux").backend == "NCCL"
    rocm = ranks.plan(2, {"gpus": [CARD, {"name": "RX 7800 XT", "vram_total_gib": 16.0}], "hip": "6.4"}, {},
                      platform="linux")
    assert rocm.backend == "RCCL" and any("slowest" in line for line in rocm.lines)
    cpu = ranks.plan(2, {"gpus": []}, {}, platform="linux")
    assert cpu.backend == "gloo" and cpu.env() == {"ACCELERATE_USE_CPU": "true"}


def test_command_is_torchrun_for_more_than_one_rank(tmp_path):
    assert ranks.Ranks(1, "cpu").command(Path("py"), tmp_path / "c.yaml")[2] == "run.py"
    command = ranks.Ranks(2, "cuda").command(Path("py"), tmp_path / "c.yaml")
    assert command[2:4] == ["-m", "torch.distributed.run"] and "--nproc-per-node=2" in command


def test_the_failed_rank_is_named_from_torchruns_report():
    report = ("Root Cause (first observed failure):\n[1]:\n  time      : 2026-12-04_05:00:00\n  host      : h\n"
              "  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 4242)\n  error_file: <N/A>\n")
    assert ranks.first_failure(report) == ("rank 1 (local rank 1, pid 4242) ended with signal 9; torchrun stopped "
                                           "the other ranks")
    assert ranks.first_failure("Traceback ... ValueError") is None


def two_images(workdir, folder: Path) -> Path:
    """Two images and captions of the tiny model's generated dataset (built here when this runs
    first), in a folder of their own."""
    folder.mkdir(parents=True)
    manifest = tiny.ensure_assets(workdir.assets / "tiny", workdir.trainer, venv_python(workdir.venv))
    for image in sorted(Path(manifest["dataset"]).glob("*.png"))[:2]:
        shutil.copy(image, folder / image.name)
        shutil.copy(image.with_suffix(".txt"), folder / f"{image.stem}.txt")
    return folder


COMPARABLE = {"optimizer": "adagrad", "lr": 1.0, "optimizer_params": {"initial_accumulator_value": 1.0},
              "force_consistent_noise": True, "min_denoising_steps": 400, "max_denoising_steps": 400}
EXACT_LORA = {"lora_matmuls": "fp32"}
"""The LoRA's matmuls in float32: bf16's (the default) round a batch of 2 and two batches of 1 apart by
far more than the averaging this compares (bf16 keeps 8 bits of mantissa)."""


COMPARE = ("import json, sys; from safetensors.torch import load_file; a = load_file(sys.argv[1]); "
           "b = load_file(sys.argv[2]); print(json.dumps({k: [float(a[k].norm()), float((a[k] - b[k]).norm())] "
           "for k in a}))")
"""Each LoRA tensor's norm in the first file and the norm of its difference to the second's."""


@pytest.fixture(scope="module")
def upstream_workdir(installed_workdirs):
    """upstream-main's workdir: the pair below trains there (its port of the data-parallel patch),
    the STOP_NOW and killed-rank tests on amd-fork; each two-rank run costs over a minute on two
    cores, so every target's patches are trained once rather than every test on both."""
    return installed_workdirs("upstream-main")


@pytest.fixture(scope="module")
def pair(upstream_workdir, tmp_path_factory):
    """The 1 x batch-2 run and the 2 x batch-1 run (fresh quantized and text caches) of the same data."""
    folder = tmp_path_factory.mktemp("data-parallel")
    dataset = two_images(upstream_workdir, folder / "dataset")
    runs = {}
    for name, batch, gpus in (("ranks", 1, "2"), ("single", 2, "1")):
        preset = tiny_preset(folder / f"{name}.yaml", steps=2, save={"dtype": "float32"},
                             train={**COMPARABLE, "batch_size": batch}, model={"model_kwargs": EXACT_LORA})
        env = {**os.environ, "AITK_QUANT_CACHE_DIR": str(folder / name / "quantized"),
               "AITK_TEXT_CACHE_DIR": str(folder / name / "text")}
        result = run_tiny(upstream_workdir.root, preset, folder / name, "--gpus", gpus, "--dataset", str(dataset),
                          env=env)
        assert result.returncode == 0, result.stdout[-6000:]
        runs[name] = (folder / name / RUN_NAME, result.stdout)
    return runs


@pytest.mark.trainer
def test_two_ranks_of_batch_1_train_the_lora_of_one_process_of_batch_2(pair, upstream_workdir):
    files = [str(pair[name][0] / RUN_NAME / f"{RUN_NAME}.safetensors") for name in ("single", "ranks")]
    result = subprocess.run([str(venv_python(upstream_workdir.venv)), "-c", COMPARE, *files], capture_output=True,
                            text=True, env=clean_env())
    assert result.returncode == 0, result.stderr[-3000:]
    tensors = json.loads(result.stdout)
    moved = {key: norm for key, (norm, _) in tensors.items() if "lora_B" in key}
    assert moved and all(norm > 0 for norm in moved.values())  # B starts at zero: its norm is what training moved
    worst = max(difference / norm for norm, difference in tensors.values())
    assert worst < TOLERANCE, f"2 x batch 1 differs from 1 x batch 2 by {worst:.2e} (relative)"


@pytest.mark.trainer
def test_one_rank_builds_the_caches_and_writes_the_run(pair):
    run, log = pair["ranks"]
    assert log.count("[quantized cache] wrote") == 1 and "waiting for rank 0 to load the model" in log
    assert log.count("Loaded quantized transformer from cache") == 1  # rank 1 reads what rank 0 wrote
    assert log.count("Saved checkpoint to") == 1
    assert json.loads((run / RUN_NAME / "run.json").read_text(encoding="utf-8"))["gpus"] == 2
    assert (run / "trainer-telemetry.jsonl").is_file() and (run / "trainer-telemetry.rank1.jsonl").is_file()


def watch(workdir, preset: Path, output: Path, until, *extra: str) -> tuple[int, str]:
    """Run the preset; call `until(line)` on each output line (it acts once it sees its moment)."""
    process = subprocess.Popen(run_command(workdir.root, preset, output, *extra), cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, errors="replace")
    lines = []
    for line in process.stdout:
        lines.append(line)
        until(line)
    return process.wait(), "".join(lines)


def rank_pids(rank: int) -> list[int]:
    """The trainer processes of torchrun's rank `rank` (its environment says RANK=rank)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            command = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if f"RANK={rank}".encode() in environ and b"run.py" in command and b"torch.distributed.run" not in command:
            found.append(int(entry.name))
    return found


@pytest.mark.trainer
def test_stop_now_stops_every_rank_and_the_run_resumes_on_one_gpu(trainer_workdir, tmp_path):
    preset = tiny_preset(tmp_path / "long.yaml", steps=400)
    job = tmp_path / RUN_NAME / RUN_NAME

    def stop_once_training(line):
        if "it/s" in line and not (job / "STOP_NOW").exists() and not list(job.glob("*.safetensors")):
            (job / "STOP_NOW").touch()

    code, log = watch(trainer_workdir, preset, tmp_path, stop_once_training, "--gpus", "2")
    assert code == 0, log[-6000:]
    # the main rank prints it; torchrun exits 0 only once rank 1 has ended too, which it does only at
    # the same step (a rank left training would wait in the next all-reduce for ever)
    assert log.count("STOP_NOW: saved checkpoint at step") == 1
    stopped = int(re.search(r"STOP_NOW: saved checkpoint at step (\d+)", log).group(1))
    short = tiny_preset(tmp_path / "short.yaml", steps=stopped + 2)
    code, log = watch(trainer_workdir, short, tmp_path, lambda line: None, "--resume", "--accept-changes")
    assert code == 0, log[-6000:]
    assert "resume on 1 GPU(s), the run trained on 2" in log


@pytest.mark.trainer
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds rank 1 through /proc")
def test_a_killed_rank_stops_the_others_with_one_line_naming_it(trainer_workdir, tmp_path):
    preset = tiny_preset(tmp_path / "long.yaml", steps=2000)
    killed = []

    def kill_rank_1(line):
        if "it/s" in line and not killed:
            for pid in rank_pids(1):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

    code, log = watch(trainer_workdir, preset, tmp_path, kill_rank_1, "--gpus", "2")
    assert killed and code != 0, log[-6000:]
    assert f"rank 1 (local rank 1, pid {killed[0]}) ended with signal 9" in log


def test_the_rank_that_keeps_the_others_waiting_is_named():
    states = {0: {"pid": 10, "entered": 8, "waiting_since": 100.0}, 1: {"pid": 11, "entered": 7, "waiting_since": None}}
    telemetry = {0: (7, False), 1: (7, False)}
    assert rank_watch.stalled(states, telemetry, 100.0 + 29, 30) is None  # not yet past the limit
    rank, line = rank_watch.stalled(states, telemetry, 100.0 + 31, 30)
    assert rank == 1 and line.startswith("rank 1 (pid 11) stalled: rank 0 has waited 31 s") and "last step 7" in line
    behind = {0: {"pid": 10, "entered": 8, "waiting_since": 100.0}, 1: {"pid": 11, "entered": 7, "waiting_since": 50.0}}
    assert rank_watch.stalled(behind, telemetry, 1000.0, 30)[0] == 1  # stopped inside the collective before
    sampling = {0: {"pid": 10, "waiting_since": None}, 1: {"pid": 11, "waiting_since": 100.0}}
    assert rank_watch.stalled(sampling, {0: (7, True), 1: (7, False)}, 1000.0, 30) is None
    assert rank_watch.stalled(sampling, {0: (7, False), 1: (7, False)}, 1000.0, 30)[0] == 0


@pytest.mark.parametrize("frozen", [0, 1])
def test_a_rank_frozen_inside_the_collective_the_others_wait_in_is_named(frozen):
    """Both files say "waiting in collective 8": the one whose heartbeat stopped is the frozen one,
    whichever entered first, and the line names the live rank that waits for it."""
    live = 1 - frozen
    states = {frozen: {"pid": 10 + frozen, "entered": 8, "waiting_since": 100.0, "beat": 100.0},
              live: {"pid": 10 + live, "entered": 8, "waiting_since": 100.0 + 5 * live, "beat": 0.0}}
    states[live]["beat"] = 1000.0
    telemetry = {0: (7, False), 1: (7, False)}
    rank, line = rank_watch.stalled(states, telemetry, 100.0 + 5 * live + 31, 30)
    assert rank == frozen, line
    assert line.startswith(f"rank {frozen} (pid {10 + frozen}) stalled: rank {live} has waited 31 s"), line
    assert "has not run for" in line and "last step 7" in line
    assert rank_watch.stalled(states, telemetry, 100.0 + 5 * live + 29, 30) is None  # the live one: not yet
    frozen_computing = {**states, frozen: {**states[frozen], "entered": 7, "waiting_since": None}}
    assert rank_watch.stalled(frozen_computing, telemetry, 1000.0, 30)[0] == frozen
    sampling = {0: (7, True), 1: (7, False)}  # sampling is no excuse for a process that does not run
    assert rank_watch.stalled(frozen_computing, sampling, 1000.0, 30)[0] == frozen


@pytest.mark.parametrize("frozen_at", [101.0, 103.5])
def test_a_rank_frozen_while_it_waits_is_named_not_taken_for_a_hung_collective(frozen_at):
    """Rank 1 waits from 100 and freezes at `frozen_at`, its last heartbeat: before rank 0 entered
    (102), or after. Its file still says it waits, and from 120 on longer than the limit, while its
    heartbeat is not yet that old: the watch waits for the heartbeat and names rank 1, never a
    hung collective."""
    def states(now):
        return {0: {"pid": 10, "entered": 8, "waiting_since": 102.0, "beat": now - 0.5},
                1: {"pid": 11, "entered": 8, "waiting_since": 100.0, "beat": frozen_at}}

    telemetry = {0: (7, False), 1: (7, False)}
    for now in (120.5, 121.0, frozen_at + 20.0):
        assert rank_watch.stalled(states(now), telemetry, now, 20) is None, now
    now = max(122.5, frozen_at + 20.5)
    rank, line = rank_watch.stalled(states(now), telemetry, now, 20)
    assert rank == 1 and line.startswith("rank 1 (pid 11) stalled: rank 0 has waited"), line
    assert "has not run for" in line


def test_every_rank_waiting_alive_in_one_collective_is_a_hung_collective():
    states = {0: {"pid": 10, "entered": 8, "waiting_since": 100.0, "beat": 995.0},
              1: {"pid": 11, "entered": 8, "waiting_since": 101.0, "beat": 996.0}}
    telemetry = {0: (7, False), 1: (7, False)}
    assert rank_watch.stalled(states, telemetry, 129.0, 30) is None
    rank, line = rank_watch.stalled(states, telemetry, 1000.0, 30)
    assert rank == 0 and line.startswith("ranks 0, 1 have waited 900 s in the same gradient all-reduce"), line
    assert "the collective itself hangs" in line and "stopping rank 0 (pid 10)" in line
    old_overlay = {rank: {key: value for key, value in state.items() if key != "beat"} for rank, state in states.items()}
    assert "collective itself hangs" in rank_watch.stalled(old_overlay, telemetry, 1000.0, 30)[1]


def test_the_watch_reads_each_ranks_files_and_forgets_an_earlier_launch(tmp_path):
    telemetry = tmp_path / "trainer-telemetry.jsonl"
    telemetry.write_text('{"step": 3}\n{"step": 4, "event": "sample_start"}\n', encoding="utf-8")
    rank_watch.rank_file(telemetry, 1).write_text('{"step": 4}\n', encoding="utf-8")
    state = tmp_path / RANK_STATE_FILE
    rank_watch.rank_file(state, 0).write_text(json.dumps({"pid": None, "waiting_since": None}), encoding="utf-8")
    rank_watch.rank_file(state, 1).write_text(json.dumps({"pid": None, "waiting_since": 0.0}), encoding="utf-8")
    watch = rank_watch.RankWatch(tmp_path, telemetry, 2, 30)
    assert watch.poll_once(1000.0) is None  # rank 0 is sampling
    telemetry.write_text('{"step": 3}\n', encoding="utf-8")
    assert "rank 0 stalled" in watch.poll_once(1000.0) and "last step 3" in watch.found
    with rank_watch.watch_ranks(tmp_path, telemetry, 2, 30):
        assert not list(tmp_path.glob("rank-state.rank*.json"))


def _waiting_for(state: Path, seconds: float) -> bool:
    since = load_json_state(state).get("waiting_since")
    return isinstance(since, (int, float)) and time.time() - since > seconds


@pytest.mark.trainer
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the ranks through /proc")
def test_a_rank_frozen_inside_the_all_reduce_stops_the_others_with_one_line_naming_it(trainer_workdir, tmp_path):
    """The state no file tells apart: rank 1 frozen (SIGSTOP) inside the collective that rank 0 then
    waits in. Made so on purpose, not by chance: rank 0 held (SIGSTOP) until rank 1 has waited for
    it a second, rank 1 frozen there, rank 0 let go into the same collective. Rank 0 is held for a
    step at most, far under the limit, so the watch cannot take it for the stalled one."""
    preset = tiny_preset(tmp_path / "long.yaml", steps=2000, launcher={"watchdog": {"rank_stall_s": 20}})
    state = {rank: rank_watch.rank_file(tmp_path / RUN_NAME / RANK_STATE_FILE, rank) for rank in (0, 1)}
    held, stopped, done = [], [], threading.Event()

    def freeze_rank_1_inside_the_collective():
        while not done.wait(0.2):
            if load_json_state(state[1]).get("entered", 0) < 2:
                continue
            held.extend(rank_pids(0))
            for pid in held:
                os.kill(pid, signal.SIGSTOP)
            while not done.wait(0.1) and not _waiting_for(state[1], 1.0):
                pass
            stopped.extend(rank_pids(1))
            for pid in stopped:
                os.kill(pid, signal.SIGSTOP)
            for pid in held:
                os.kill(pid, signal.SIGCONT)
            if not done.wait(180):  # the watch missed it: end the run all the same (the test fails below)
                for pid in stopped:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
            return

    freezer = threading.Thread(target=freeze_rank_1_inside_the_collective, daemon=True)
    freezer.start()
    try:
        code, log = watch(trainer_workdir, preset, tmp_path, lambda line: None, "--gpus", "2")
    finally:
        done.set()
        freezer.join()
        for pid in held:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
        for pid in stopped:  # never leave a stopped process behind
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    assert stopped and code != 0, log[-6000:]
    assert log.count(f"rank 1 (pid {stopped[0]}) stalled: rank 0 has waited") == 1, log[-6000:]
    assert "its process has not run for" in log, log[-6000:]


def test_the_dry_run_plans_each_card_on_its_own():
    process = {"model": {"model_kwargs": {"memory_plan": "auto"}}, "datasets": [{"resolution": [512]}],
               "train": {"batch_size": 1}, "network": {"linear": 32}}
    small = {"name": "RX 7800 XT", "vram_total_gib": 16.0}
    lines = memory_plan.card_plans({"config": {"process": [process]}}, (CARD, small))
    first, second = lines.index("GPU 0 (RTX 4090, 23.6 GiB), budget 22.1 GiB:"), lines.index(
        "GPU 1 (RX 7800 XT, 16.0 GiB), budget 14.5 GiB:")
    assert lines[first + 1:second] != lines[second + 1:-1]  # two cards, two plans
    assert "waits for the slowest rank" in lines[-1]
    assert memory_plan.card_plans({"config": {"process": [process]}}, (CARD,)) == []

"""The real rescue burst (and the plot) with the trainer venv's interpreter, on a CPU at tiny sizes.

They need torch / matplotlib, so they run in the trainer's venv (fixture `trainer_workdir`,
built once per test run; LAUNCHER_TEST_WORKDIR names an existing one). One more runs the
recipe-size burst where the trainer's torch sees a GPU (marker `gpu`).
"""

import json
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from launcher.envs.trainer_python import LAUNCHER_ROOT
from launcher.envs.workdir import venv_python
from launcher.watchdog.loop import SubprocessBurster
from launcher.watchdog.policy import load_config
from launcher.watchdog.replay import default_scenario, simulate

pytestmark = pytest.mark.trainer

TINY = ["--device", "cpu", "--m", "64", "--k", "64", "--n", "128"]


@pytest.fixture(scope="module")
def venv_py(trainer_workdir) -> Path:
    python = venv_python(trainer_workdir.venv)
    assert python.is_file(), f"no interpreter at {python}"
    return python


def run_module(python: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), *args], cwd=LAUNCHER_ROOT, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(LAUNCHER_ROOT), "PATH": "", "HOME": tempfile.gettempdir()})


def test_a_burst_measures_and_reports_its_rate(venv_py):
    done = run_module(venv_py, "-m", "launcher.in_trainer.burst", "--seconds", "1.0", *TINY)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, "the burst prints exactly one line"
    result = json.loads(lines[0])
    assert result["ok"] and result["dtype"] == "fp32" and result["device"] == "cpu"
    assert result["iterations"] >= 1 and result["seconds"] >= 1.0
    expected = 2 * 64 * 64 * 128 * result["iterations"] / result["seconds"] / 1e12
    assert result["tflops"] == pytest.approx(expected, rel=1e-2, abs=1e-4) and result["tflops"] > 0


@pytest.mark.gpu
def test_a_burst_on_the_gpu_runs_the_recipe_size_in_bf16(venv_py):
    has_gpu = run_module(venv_py, "-c", "import torch; print(torch.cuda.is_available())")
    if has_gpu.stdout.strip() != "True":
        pytest.skip("needs a GPU that the trainer's torch sees")
    done = run_module(venv_py, "-m", "launcher.in_trainer.burst", "--seconds", "3", "--device", "cuda")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip())
    assert result["ok"] and result["dtype"] == "bf16" and result["device"] == "cuda"
    assert (result["m"], result["k"], result["n"]) == (6144, 6144, 18432)
    expected = 2 * 6144 * 6144 * 18432 * result["iterations"] / result["seconds"] / 1e12
    assert result["tflops"] == pytest.approx(expected, rel=1e-2) and result["tflops"] > 0


def test_a_failing_burst_still_prints_one_json_line(venv_py):
    done = run_module(venv_py, "-m", "launcher.in_trainer.burst", "--seconds", "0.1", "--device", "nonsense")
    assert done.returncode == 1
    result = json.loads(done.stdout.strip())
    assert result["ok"] is False and "nonsense" in result["error"]


def test_the_watchdog_runs_a_fresh_burst_and_calls_it_a_dud_on_a_cpu(venv_py):
    config = load_config({"burst_s": 0.5, "burst_device": "cpu", "burst_m": 64, "burst_k": 64, "burst_n": 128,
                          "burst_timeout_s": 240})
    burster = SubprocessBurster(venv_py, config)
    burster.start(time.time())
    deadline = time.time() + 240
    result = None
    while result is None and time.time() < deadline:
        time.sleep(0.2)
        result = burster.poll(time.time())
    assert result is not None and result.ok and 0 < result.tflops < config.dud_tflops


def test_plot_of_the_synthetic_2000_step_run_marks_every_burst(venv_py, tmp_path):
    paths = simulate(default_scenario(), load_config({"enabled": True})).write(tmp_path / "run")
    out = tmp_path / "plot.png"
    done = run_module(venv_py, "-m", "launcher.in_trainer.plot", str(paths["telemetry"]), str(out),
                      "--events", str(paths["events"]))
    assert done.returncode == 0, done.stderr
    check = (
        "import sys, matplotlib.image as m, numpy as n; a = m.imread(sys.argv[1]); "
        "print(a.shape[0], a.shape[1], float(n.std(a[..., :3])))"
    )
    height, width, spread = run_module(venv_py, "-c", check, str(out)).stdout.split()
    assert int(height) > 500 and int(width) > 800 and float(spread) > 0.05, "the plot looks blank"
    # one telemetry row per 10 s: most of the 2000 steps appear
    from launcher.in_trainer.plot import series
    data = series([json.loads(line) for line in paths["telemetry"].read_text().splitlines()])
    assert len(data["s_it"][0]) > 1800 and len(data["power_w"][0]) > 1000

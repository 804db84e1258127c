"""What one `run` of the tiny preset leaves beside the LoRA: telemetry rows, run.json, a plot."""

import json
import subprocess
import sys

import pytest
from tiny_run import REPO, RUN_NAME, run_tiny, tiny_preset

from launcher.envs.workdir import read_state, venv_python
from launcher.runs.folders import RunFolder
from launcher.runs.presets import load_preset

pytestmark = pytest.mark.trainer


@pytest.fixture(scope="module")
def tiny_run(trainer_workdir, tmp_path_factory):
    """The tiny preset with 4 steps and a 1 s telemetry interval, in a fresh output folder."""
    folder = tmp_path_factory.mktemp("outputs")
    preset = tiny_preset(folder / "tiny.yaml", steps=4, launcher={"telemetry": {"interval_s": 1}})
    result = run_tiny(trainer_workdir.root, preset, folder / "out")
    assert result.returncode == 0, result.stdout[-6000:]
    return trainer_workdir, RunFolder(folder / "out" / RUN_NAME, RUN_NAME)


def test_telemetry_rows_hold_in_trainer_figures(tiny_run):
    _, run = tiny_run
    rows = [json.loads(line) for line in run.telemetry.read_text().splitlines()]
    trained = [row for row in rows if row.get("step")]
    assert trained, rows
    last = trained[-1]
    assert last["step"] == 4 and isinstance(last["loss"], float)
    for key in ("vram_allocated_gib", "vram_reserved_gib", "host_rss_gib"):
        assert key in last, key  # read inside the trainer (wall 10); VRAM is null on a CPU
    assert isinstance(last["host_rss_gib"], float) and last["host_rss_gib"] > 0


def test_run_json_names_what_ran(tiny_run):
    workdir, run = tiny_run
    meta = json.loads(run.metadata.read_text())
    state = read_state(workdir.state_file)
    assert meta["commit"] == state["commit"] and meta["patches"] == state["patches"]
    assert meta["preset_sha256"] == load_preset(meta["preset"]).sha256 and meta["preset_inherits"] == []
    assert meta["torch"]["torch"].startswith("2.11.0")
    load = meta["load"]  # this launch's figures, from the trainer's telemetry rows
    assert 0 < load["host_peak_rss_gib"] < 64
    transformer = load["phases"]["transformer"]
    assert transformer["source"] in ("cache", "streamed") and transformer["seconds"] > 0
    assert load["to_first_step_s"] > transformer["seconds"]


def test_plot_writes_a_png_with_data(tiny_run, capsys):
    workdir, run = tiny_run
    out = run.root / "plot.png"
    result = subprocess.run(
        [sys.executable, "-m", "launcher", "plot", str(run.root), "--workdir", str(workdir.root), "--out", str(out)],
        cwd=REPO, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr
    check = (
        "import sys, matplotlib.image as m, numpy as n; a = m.imread(sys.argv[1]); "
        "print(float(n.std(a[..., :3])))"
    )
    spread = subprocess.run([str(venv_python(workdir.venv)), "-c", check, str(out)],
                            capture_output=True, text=True, check=True).stdout
    assert float(spread) > 0.05, "the plot looks blank"

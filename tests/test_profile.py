"""`run --profile N`: torch.profiler over N whole training steps, written beside the run.

A 4-step tiny run on the CPU with `--profile 2`: the profiler starts after the 2 warm-up
steps, so steps 3 and 4 are profiled, and training ends before the window is closed by a
fifth step: the files must still be written then.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flux2_contract import files

REPO = Path(__file__).resolve().parent.parent
STEPS = 4


@pytest.fixture(scope="module")
def profiled_run(trainer_workdir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("profiled")
    preset = yaml.safe_load((REPO / "presets" / "tiny.yaml").read_text(encoding="utf-8"))
    preset["config"]["process"][0]["train"]["steps"] = STEPS
    path = tmp / "tiny.yaml"
    path.write_text(yaml.safe_dump(preset, sort_keys=False), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "launcher", "run", str(path), "--workdir", str(trainer_workdir.root),
         "--output", str(tmp / "out"), "--profile", "2"],
        cwd=REPO, capture_output=True, text=True, errors="replace",
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    return tmp / "out" / preset["config"]["name"], result.stdout


@pytest.mark.trainer
def test_the_trace_and_the_table_are_beside_the_run(profiled_run):
    run_dir, out = profiled_run
    folder = run_dir / files.PROFILE_DIR
    trace = json.loads((folder / files.PROFILE_TRACE).read_text(encoding="utf-8"))
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"aten::mm", "aten::addmm"} & names, "the model's matmuls are not in the trace"
    table = (folder / files.PROFILE_TABLE).read_text(encoding="utf-8")
    summary = table.splitlines()[0]
    assert summary.startswith("2 steps in ") and "s/step" in summary
    assert "top 20 by self CPU time" in table and "top 20 by CPU time" in table
    assert table.count("aten::") >= 20
    assert f"[profile] {summary}" in out and str(folder) in out



@pytest.mark.trainer
def test_the_step_breakdown_is_written_and_printed(profiled_run):
    run_dir, out = profiled_run
    folder = run_dir / files.PROFILE_DIR
    result = json.loads((folder / files.PROFILE_BREAKDOWN).read_text(encoding="utf-8"))
    assert result["steps"] == 2 and result["step_ms"] > 0
    assert set(result["category_ms"]) >= {"block GEMMs", "requantization", "attention", "LoRA matmuls", "optimizer"}
    # On the CPU there are no GPU kernels: nothing is charged, and the GPU is idle the whole step.
    assert sum(result["category_ms"].values()) == 0 and result["gpu_idle_ms"] == result["step_ms"]
    assert "[profile] step breakdown, ms per step" in out
    assert "step breakdown" in (folder / files.PROFILE_TABLE).read_text(encoding="utf-8")

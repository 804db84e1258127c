"""The user's versions, as far as Linux can hold them (tests/user_stack.py: the rocm-windows
channel's torch 2.13.0, torchvision 0.28.0, Triton 3.7.1 and requirement overrides, installed by
the launcher's own code): the tiny preset trains through `python -m launcher run`, the quantize /
stream / compile / resume in-trainer tests pass, and every Triton kernel of the project compiles
for RDNA3 and RDNA4 with Triton 3.7.1 without a spill or a wrong matrix unit."""

import csv
import subprocess

import pytest
from tiny_run import REPO, RUN_NAME, run_tiny

from launcher.envs.torchenv import clean_env
from launcher.envs.workdir import venv_python
from launcher.runs.folders import RunFolder

pytestmark = pytest.mark.trainer

RDNA = ("gfx1100", "gfx1101", "gfx1201")


def test_the_in_trainer_tests_pass_on_the_user_stack(user_stack):
    user_stack.workdir()
    returncode, output, errors = user_stack.suite.wait()
    print(output[-20000:], errors[-5000:])
    assert returncode == 0, "the user stack's in-trainer tests failed; the report is above"
    summary = output.splitlines()[-1]
    assert " passed" in summary and " skipped" not in summary and " failed" not in summary, summary


def test_the_tiny_preset_trains_on_the_user_stack(user_stack, tmp_path):
    result = run_tiny(user_stack.workdir().root, output=tmp_path)
    assert result.returncode == 0, result.stdout[-6000:]
    assert RunFolder(tmp_path / RUN_NAME, RUN_NAME).saved_lora(None).name == f"{RUN_NAME}.safetensors"


def test_triton_3_7_compiles_every_kernel_for_rdna(user_stack, tmp_path):
    """bench/kernel_isa.py on the checkout's kernels, with the venv's Triton (3.7.1)."""
    workdir = user_stack.workdir()
    out = tmp_path / "kernel_isa.csv"
    result = subprocess.run([str(venv_python(workdir.venv)), str(REPO / "bench" / "kernel_isa.py"),
                             "--trainer", str(workdir.trainer), "--targets", ",".join(RDNA), "--out", str(out)],
                            cwd=REPO, env=clean_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    with out.open(encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert {row["target"] for row in rows} == set(RDNA)
    assert all(row["verdict"] == "ok" for row in rows)

"""doctor: the in-process probe through the trainer venv, and the known-bad settings."""

import json

import pytest

from launcher.cli import main
from launcher.checkup import known_problems


def report(system="Linux", hip=None, gpu=True, free=500.0, ram=64.0, swap=32.0, allocator=None, stale=None):
    return {
        "platform": {"system": system},
        "torch": {"torch": "2.12.0", "hip": hip, "gpu_available": gpu},
        "allocator": {"PYTORCH_HIP_ALLOC_CONF": allocator},
        "free_disk_gib": free,
        "workdir": "/w",
        "memory_gib": {"ram_total": ram, "swap_total": swap},
        "selftest": {"summary": "passed", "stale": stale, "fastest": "int4_fused"},
    }


@pytest.mark.trainer
def test_doctor_json_on_this_machine(trainer_workdir, capsys):
    assert main(["doctor", "--json", "--workdir", str(trainer_workdir.root)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["torch"]["torch"].startswith("2.11.0")
    assert isinstance(data["torch"]["gpu_available"], bool)
    assert data["memory_gib"]["ram_total"] > 0
    assert data["free_disk_gib"] > 0
    assert set(data["allocator"]) >= {"PYTORCH_HIP_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"}
    if not data["torch"]["gpu_available"]:
        assert any("no GPU" in warning for warning in data["warnings"])


def test_doctor_without_a_venv_says_how_to_fix(tmp_path, capsys):
    assert main(["doctor", "--workdir", str(tmp_path)]) == 0
    assert "run `python -m launcher setup`" in capsys.readouterr().out


def test_rocm_on_windows_warns_about_layer_offloading():
    problems = known_problems(report(system="Windows", hip="7.2.53211"))
    assert any("layer_offloading: false" in p and "disable_sampling: true" in p for p in problems)
    assert not any("192259" in p for p in problems)


def test_rocm_on_linux_and_cuda_on_windows_get_no_wall_5_warning():
    for system, hip in (("Linux", "7.2.53211"), ("Windows", None)):
        assert not any("layer_offloading" in p for p in known_problems(report(system=system, hip=hip))), system


def test_expandable_segments_hang_release_is_flagged():
    problems = known_problems(report(hip="7.14.60850", allocator="expandable_segments:True"))
    assert any("pytorch/pytorch#192259" in p and "set in this shell" in p for p in problems)


def test_healthy_cuda_box_has_no_warnings():
    assert known_problems(report()) == []


def test_small_disk_and_memory_are_flagged():
    problems = known_problems(report(free=10.0, ram=32.0, swap=0.0))
    assert any("10.0 GiB free" in p for p in problems) and any("pagefile" in p for p in problems)


def test_a_stale_selftest_is_flagged_with_what_to_run():
    problems = known_problems(report(stale="the trainer build changed"))
    assert any("the trainer build changed" in p and "launcher selftest" in p for p in problems), problems

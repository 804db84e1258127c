"""The ROCm runtime choices the self-test measures, decided on the CPU from injected results: the
BLAS library behind `rocm_blas: auto` (hipBLAS or hipBLASLt, the faster at the 4-bit path's GEMMs),
what `run` writes for it on ROCm, NVIDIA and without a self-test, and the VAE convolution check's
lines in the report and in `doctor`."""

import json
from types import SimpleNamespace

import pytest

from launcher import resolve
from launcher.envs.workdir import Workdir
from launcher.in_trainer.selftest import blas, kernels
from launcher.selftest import report, verdict
from launcher.selftest.verdict import Verdicts

ROCM = {"created": "2026-12-04T10:00:00+0000", "environment": {"hip": "7.1", "gpu": {"name": "Radeon RX 7900 XTX",
                                                                                     "vram_gib": 24.0, "arch": "gfx1100"}},
        "fastest": {"qtype": "int4_fused", "candidate": "int4_fused", "kernel": {}}}


def workdir_with(tmp_path, result: dict | None) -> Workdir:
    """A workdir whose selftest.json holds `result`, stamped with its build (none when None)."""
    workdir = Workdir(tmp_path / "wd")
    workdir.root.mkdir(parents=True, exist_ok=True)
    workdir.state_file.write_text(json.dumps({"target": "amd-fork", "commit": "abc", "patches": {"p": "1"}}))
    if result is not None:
        workdir.selftest.write_text(json.dumps({**result, "trainer": verdict.trainer_build(workdir)}))
    return workdir


@pytest.mark.parametrize("step_ms, default, library", [
    ({"hipblas": 100.0, "hipblaslt": 80.0}, "hipblas", "hipblaslt"),  # 25 % faster: taken
    ({"hipblas": 70.0, "hipblaslt": 100.0}, "hipblaslt", "hipblas"),
    ({"hipblas": 100.0, "hipblaslt": 98.0}, "hipblas", "default"),  # within the margin: PyTorch's pick stays
    ({"hipblas": 100.0, "hipblaslt": None}, "hipblas", "default"),  # only the default ran
    ({"hipblas": None, "hipblaslt": 90.0}, "hipblas", "hipblaslt"),  # only the other one ran
    ({"hipblas": None, "hipblaslt": None}, "hipblas", "default"),
])
def test_the_faster_library_is_chosen_beyond_the_margin(step_ms, default, library):
    choice = blas.pick(step_ms, default)
    assert choice["library"] == library and choice["reason"]


def test_the_timed_gemms_are_the_slices_the_4bit_path_multiplies():
    """int4_fused's forward dequantizes 64 MiB of rows at a time (5440 of 6144 inputs), its input
    gradient 64-column groups; forwards count twice (checkpointing recomputes them)."""
    gemms = blas.gemm_cases([("single.linear1", 6144, 55296, 1536, 48)])
    forward = [g for g in gemms if not g["transposed"]]
    assert {g["n"] for g in forward} == {5440, 55296 % 5440} and all(g["k"] == 6144 for g in forward)
    assert sum(g["calls"] * g["n"] for g in forward) == 2 * 48 * 55296
    backward = [g for g in gemms if g["transposed"]]
    assert sum(g["calls"] * g["n"] for g in backward) == 48 * 6144 and all(g["n"] % 64 == 0 for g in backward)
    every = blas.gemm_cases(kernels.block_linear_cases(1024, 512))
    assert {g["m"] for g in every} == {1024, 512, 1536}


def test_no_gpu_and_nvidia_are_not_timed():
    cpu = SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: False))
    assert "no GPU" in blas.check(cpu, True, [], None, None, print)["reason"]
    nvidia = SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: True))
    skipped = blas.check(nvidia, False, [], "cuda", None, print)
    assert skipped == {"ran": False, "library": "default", "reason": "NVIDIA: cuBLAS/cuBLASLt stay PyTorch's pick"}


def resolved(config: dict, workdir) -> str | None:
    """What `run` says of the BLAS library of the config's one process."""
    return resolve.rocm_blas(config["config"]["process"][0], Verdicts.read(workdir))


def config_with(**kwargs) -> dict:
    return {"config": {"process": [{"model": {"qtype": "int4_fused", "model_kwargs": dict(kwargs)}}]}}


def test_run_writes_the_self_tests_library_on_rocm(tmp_path):
    result = {**ROCM, "blas": {"ran": True, "library": "hipblaslt", "reason": "hipblaslt 80.0 ms, hipblas 100.0 ms"}}
    config = config_with()  # unset means auto
    line = resolved(config, workdir_with(tmp_path, result))
    assert config["config"]["process"][0]["model"]["model_kwargs"]["rocm_blas"] == "hipblaslt"
    assert line.startswith("rocm_blas auto -> hipblaslt: hipblaslt 80.0 ms") and "Radeon RX 7900 XTX" in line


@pytest.mark.parametrize("result", [None, {**ROCM, "environment": {"gpu": {"name": "NVIDIA H200"}},
                                           "blas": {"ran": False, "library": "default", "reason": "NVIDIA"}}])
def test_without_a_rocm_self_test_it_is_the_default_and_run_says_nothing(tmp_path, result):
    config = config_with(rocm_blas="auto")
    assert resolved(config, workdir_with(tmp_path, result)) is None
    assert config["config"]["process"][0]["model"]["model_kwargs"]["rocm_blas"] == "default"


def test_a_library_the_preset_names_is_kept(tmp_path):
    result = {**ROCM, "blas": {"ran": True, "library": "hipblaslt", "reason": "faster"}}
    config = config_with(rocm_blas="hipblas")
    assert resolved(config, workdir_with(tmp_path, result)) is None
    assert config["config"]["process"][0]["model"]["model_kwargs"]["rocm_blas"] == "hipblas"


def test_the_convolution_check_reaches_the_report_and_doctor():
    failed = {**ROCM, "convolution": {"ran": True, "passed": False, "library": "MIOpen",
                                      "error": "RuntimeError: miopenStatusUnknownError"}}
    assert "FAIL  RuntimeError: miopenStatusUnknownError" in "\n".join(report.convolution_lines(failed["convolution"]))
    shown = verdict.rocm_runtime(failed)
    assert shown["convolution_failed"] and "miopenStatusUnknownError" in shown["convolution"]
    passed = {**ROCM, "convolution": {"ran": True, "passed": True, "library": "MIOpen", "seconds": 0.4,
                                      "max_relative_difference": 0.003}}
    assert verdict.rocm_runtime(passed)["convolution"] == "pass (MIOpen, 0.4 s)"
    assert verdict.rocm_runtime(None)["convolution_failed"] is False


def test_overlapped_streaming_is_not_tried_on_amd_and_auto_stays_serialized():
    """The self-test does not run the overlapped trial on a ROCm GPU (a HIP driver hang may outlive
    the child); the report says so, not FAIL, and `stream_mode: auto` is serialized there."""
    from launcher.in_trainer.selftest import streaming

    skipped = streaming.not_on_amd()
    lines = "\n".join(report.streaming_lines(skipped))
    assert "not run: not run on AMD GPUs" in lines and "FAIL" not in lines and "stream serialized" in lines
    mode, why = verdict.streaming_from({**ROCM, "streaming": skipped})
    assert mode == "serialized" and "not tried on AMD GPUs" in why
    nvidia = {**ROCM, "environment": {"gpu": {"name": "NVIDIA H200"}},
              "streaming": {"passed": True, "completed": True, "device": "cuda", "seconds": 20}}
    assert verdict.streaming_from(nvidia)[0] == "overlapped"

"""The ROCm runtime choices the self-test measures, decided on the CPU from injected results and
stand-ins of torch: the BLAS library behind `rocm_blas: auto` (hipBLAS or hipBLASLt, the faster at
the 4-bit path's GEMMs; hipBLAS untimed on RDNA4), the attention kernels behind `sdpa_kernels: auto`,
MIOpen's search behind `miopen_find_mode: auto` (the VAE convolution's first call), what `run` writes
for each on ROCm, NVIDIA and without a self-test, and the variables it sets from them."""

import json
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from launcher import resolve
from launcher.envs.workdir import Workdir
from launcher.in_trainer.selftest import attention, blas, convolution, kernels
from launcher.runs import trainer_env
from launcher.runs.schema import Vocabulary
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
    assert "no GPU" in blas.check(cpu, True, "", [], None, None, print)["reason"]
    nvidia = SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: True))
    skipped = blas.check(nvidia, False, "sm_90", [], "cuda", None, print)
    assert skipped == {"ran": False, "library": "default", "reason": "NVIDIA: cuBLAS/cuBLASLt stay PyTorch's pick"}


def resolved(config: dict, workdir) -> str | None:
    """What `run` says of the BLAS library of the config's one process, which takes the resolved process."""
    processes = config["config"]["process"]
    processes[0], line = resolve.rocm_blas(processes[0], Verdicts.read(workdir))
    return line


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
    passed = {**ROCM, "convolution": {"ran": True, "passed": True, "library": "MIOpen", "first_s": 0.4,
                                      "second_s": 0.01, "max_relative_difference": 0.003, "find_mode": "default",
                                      "reason": "quick"}}
    assert verdict.rocm_runtime(passed)["convolution"] == "pass (MIOpen, first call 0.4 s)"
    lines = "\n".join(report.convolution_lines(passed["convolution"]))
    assert "first call 0.4 s, second 0.01 s" in lines and "`miopen_find_mode: auto` -> default (quick)" in lines
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


# --------------------------------------------------------------------------- hipBLASLt on RDNA4

class Refusing:
    """A timer or torch stand-in that fails the test if the BLAS check touches it."""

    def __call__(self, *args):
        raise AssertionError("hipBLASLt was timed")

    def __getattr__(self, name):
        raise AssertionError(f"torch.{name} was used")


def gpu_torch(hip: bool = True, **more) -> SimpleNamespace:
    """The parts of torch every check asks first: a GPU, a ROCm or CUDA build."""
    return SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: True, synchronize=lambda: None),
                           version=SimpleNamespace(hip="7.1" if hip else None), **more)


@pytest.mark.parametrize("arch", ["gfx1200", "gfx1201", "gfx1201:sramecc-:xnack-"])
def test_on_rdna4_hiplaslt_is_not_timed_and_hipblas_is_taken(arch):
    """With ROCm 10.0.0 hipBLASLt reset RX 9070 / R9700 GPUs in training: the self-test, the first
    thing a new owner runs, must not time it there."""
    torch = gpu_torch(backends=Refusing())
    choice = blas.check(torch, True, arch, kernels.block_linear_cases(1024, 512), "cuda", Refusing(), print)
    assert choice["ran"] is False and choice["library"] == "hipblas"
    assert "#7699" in choice["reason"] and "TORCH_BLAS_PREFER_HIPBLASLT=0" in choice["reason"]
    library, why = verdict.blas_from({**ROCM, "blas": choice})
    assert library == "hipblas" and "#7699" in why


def test_rdna3_and_nvidia_have_no_reset_rule():
    assert blas.resets("gfx1100") is None and blas.resets("gfx1101") is None and blas.resets("sm_89") is None


def test_run_writes_hipblas_for_an_rdna4_self_test(tmp_path):
    choice = blas.check(gpu_torch(backends=Refusing()), True, "gfx1201", [], "cuda", Refusing(), print)
    config = config_with()
    line = resolved(config, workdir_with(tmp_path, {**ROCM, "blas": choice}))
    assert config["config"]["process"][0]["model"]["model_kwargs"]["rocm_blas"] == "hipblas"
    assert line.startswith("rocm_blas auto -> hipblas: gfx1201: hipBLASLt not timed")


# --------------------------------------------------------------------------- MIOpen's first call

class Value:
    """A stand-in tensor: one number, with the arithmetic the checks do on outputs."""

    def __init__(self, value: float):
        self.value = value

    def float(self):
        return self

    def detach(self):
        return self

    def requires_grad_(self, flag):
        return self

    def backward(self, grad=None):
        pass

    def norm(self):
        return Value(abs(self.value))

    def clamp_min(self, low):
        return Value(max(self.value, low))

    def __sub__(self, other):
        return Value(self.value - other.value)

    def __mul__(self, scale):
        return Value(self.value * scale)

    def __truediv__(self, other):
        return Value(self.value / other.value)

    def __float__(self):
        return float(self.value)


def conv_torch(hip: bool, library_output: float = 1.0) -> SimpleNamespace:
    """torch with a convolution whose result depends on whether the vendor library is enabled."""
    state = []

    @contextmanager
    def flags(enabled: bool):
        state.append(enabled)
        yield
        state.pop()

    conv2d = lambda x, w, padding: Value(library_output if state[-1] else 1.0)  # noqa: E731
    return gpu_torch(hip, Generator=lambda device: SimpleNamespace(manual_seed=lambda seed: None),
                     randn=lambda *shape, **kw: Value(1.0), bfloat16="bf16",
                     backends=SimpleNamespace(cudnn=SimpleNamespace(flags=flags)),
                     nn=SimpleNamespace(functional=SimpleNamespace(conv2d=conv2d)))


def clock(*times):
    """perf_counter's stand-in: the given readings, in turn."""
    readings = iter(times)
    return lambda: next(readings)


@pytest.mark.parametrize("first, second, mode", [
    (convolution.SLOW_FIRST_CALL_S + 0.6, 0.5, "fast"),  # the search alone is past the threshold
    (convolution.SLOW_FIRST_CALL_S + 0.4, 0.5, "default"),  # the first call is slow only by the convolution itself
    (0.3, 0.01, "default"),
])
def test_a_slow_first_miopen_call_asks_for_the_fast_find_mode(first, second, mode):
    found = convolution.check(conv_torch(hip=True), "cuda", clock(0.0, first, 100.0, 100.0 + second))
    assert found["passed"] and found["find_mode"] == mode
    assert (found["first_s"], found["second_s"]) == (round(first, 2), round(second, 3))
    assert verdict.find_mode_from({**ROCM, "convolution": found})[0] == mode


def test_the_threshold_is_the_first_encodes_budget_over_its_shapes():
    assert convolution.SLOW_FIRST_CALL_S * convolution.ENCODER_SHAPES == pytest.approx(convolution.FIRST_ENCODE_BUDGET_S)


def test_cudnn_never_asks_for_a_miopen_find_mode():
    found = convolution.check(conv_torch(hip=False), "cuda", clock(0.0, 60.0, 60.0, 60.1))
    assert found["library"] == "cuDNN" and found["find_mode"] == "default"


def test_a_wrong_miopen_convolution_fails():
    found = convolution.check(conv_torch(hip=True, library_output=2.0), "cuda", clock(0.0, 0.1, 0.1, 0.2))
    assert not found["passed"] and "differs from the convolution without MIOpen" in found["error"]


# --------------------------------------------------------------------------- the attention kernels

def sdpa_torch(runs: set, outputs: dict | None = None) -> SimpleNamespace:
    """torch whose SDPA runs only the backends in `runs` (`outputs`: each one's forward value)."""
    active = []

    @contextmanager
    def sdpa_kernel(backends):
        active.append(backends[0])
        yield
        active.pop()

    def sdpa(q, k, v):
        if active[-1] not in runs:
            raise RuntimeError("No available kernel. Aborting execution.")
        return Value((outputs or {}).get(active[-1], 1.0))

    backend = SimpleNamespace(**{name: name for name in attention.BACKENDS})
    return gpu_torch(Generator=lambda device: SimpleNamespace(manual_seed=lambda seed: None),
                     randn=lambda *shape, **kw: Value(1.0), bfloat16="bf16", ones_like=lambda t: Value(1.0),
                     nn=SimpleNamespace(attention=SimpleNamespace(sdpa_kernel=sdpa_kernel, SDPBackend=backend),
                                        functional=SimpleNamespace(scaled_dot_product_attention=sdpa)))


def timer(fn):
    fn()
    return 5.0


def test_each_backend_is_tried_and_compared_with_math():
    found = attention.backends(sdpa_torch({"EFFICIENT_ATTENTION", "MATH"}, {"EFFICIENT_ATTENTION": 1.001}), "cuda",
                               1536, timer)
    assert list(found) == list(attention.BACKENDS)
    assert not found["FLASH_ATTENTION"]["ran"] and "No available kernel" in found["FLASH_ATTENTION"]["error"]
    assert found["EFFICIENT_ATTENTION"] == {"ran": True, "ms": 5.0, "difference": pytest.approx(1e-3)}
    assert attention.fastest_kernel(found) == "EFFICIENT_ATTENTION"


@pytest.mark.parametrize("here, child, hip, kernels, probed", [
    ({"FLASH_ATTENTION", "MATH"}, None, True, "default", False),
    ({"MATH"}, {"FLASH_ATTENTION", "MATH"}, True, "experimental", True),  # the variable helps: `run` sets it
    ({"MATH"}, {"MATH"}, True, "math", True),  # it does not: the plan holds the matrices
    ({"MATH"}, None, False, "math", False),  # NVIDIA: the variable is ROCm's
])
def test_only_math_tries_the_experimental_variable_on_rocm(monkeypatch, here, child, hip, kernels, probed):
    monkeypatch.delenv(attention.VARIABLE, raising=False)
    torch = sdpa_torch(here)
    torch.version.hip = "7.1" if hip else None
    asked = []

    def probe(tokens):
        asked.append(tokens)
        return attention.backends(sdpa_torch(child), "cuda", tokens, timer)

    found = attention.check(torch, hip, "cuda", 1536, timer, print, probe)
    assert found["kernels"] == kernels and (asked == [1536]) is probed
    assert verdict.attention_from({**ROCM, "attention": found})[0] == kernels


def test_a_kernel_that_disagrees_with_math_is_not_taken(monkeypatch):
    monkeypatch.delenv(attention.VARIABLE, raising=False)
    wrong = sdpa_torch({"FLASH_ATTENTION", "MATH"}, {"FLASH_ATTENTION": 1.5})
    found = attention.check(wrong, True, "cuda", 1536, timer, print, lambda tokens: None)
    assert found["kernels"] == "math"


def test_with_the_variable_already_set_a_running_kernel_keeps_it(monkeypatch):
    monkeypatch.setenv(attention.VARIABLE, "1")
    found = attention.check(sdpa_torch({"FLASH_ATTENTION", "MATH"}), True, "cuda", 1536, timer, print, Refusing())
    assert found["kernels"] == "experimental" and found["variable_was_on"]


def test_the_attention_check_reaches_the_report():
    found = attention.check(sdpa_torch({"MATH"}), False, "cuda", 1536, timer, print)
    lines = "\n".join(report.attention_lines(found))
    assert "FLASH_ATTENTION" in lines and "No available kernel" in lines and "chosen: math (only math ran" in lines


# --------------------------------------------------------------------------- what `run` does with them

@pytest.mark.parametrize("kernels, mode, env", [
    ("experimental", "fast", {"TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL": "1", "MIOPEN_FIND_MODE": "FAST"}),
    ("math", "default", {}),
    ("default", "default", {}),
])
def test_run_resolves_the_verdicts_and_sets_their_variables(tmp_path, kernels, mode, env):
    result = {**ROCM, "attention": {"ran": True, "kernels": kernels, "reason": "found"},
              "convolution": {"ran": True, "passed": True, "find_mode": mode, "reason": "timed"}}
    config = config_with()
    verdicts = Verdicts.read(workdir_with(tmp_path, result))
    process, attends = resolve.sdpa_kernels(config["config"]["process"][0], verdicts)
    process, searched = resolve.miopen_find_mode(process, verdicts)
    assert attends.startswith(f"sdpa_kernels auto -> {kernels}: found")
    assert searched.startswith(f"miopen_find_mode auto -> {mode}: timed")
    assert trainer_env.from_settings({"config": {"process": [process]}}) == env


def test_a_presets_value_is_kept_and_sets_the_variable_without_a_self_test(tmp_path):
    config = config_with(sdpa_kernels="experimental", miopen_find_mode="default")
    verdicts = Verdicts.read(workdir_with(tmp_path, None))
    process = config["config"]["process"][0]
    assert resolve.sdpa_kernels(process, verdicts) == (process, None)
    assert resolve.miopen_find_mode(process, verdicts) == (process, None)
    assert trainer_env.from_settings(config) == {"TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL": "1"}


@pytest.mark.parametrize("name, setting", [("TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL", "sdpa_kernels: experimental"),
                                           ("MIOPEN_FIND_MODE", "miopen_find_mode: fast"),
                                           ("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "lora_matmuls: tf32")])
def test_a_presets_env_cannot_set_what_a_setting_sets(name, setting):
    problems = list(trainer_env.env_block().check({name: "1"}, "launcher.env", Vocabulary()))
    assert len(problems) == 1 and f"set model_kwargs {setting} in the preset" in problems[0]

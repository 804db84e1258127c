"""The ROCm runtime choices the self-test measures: the BLAS library the FLUX.2 model sets before
its first matmul (`rocm_blas`), the self-test's timing of both libraries (the selection on fake
backends here: no ROCm GPU), the VAE encode that survives a MIOpen failure, and the rule that
no 8-bit path goes through `torch._int_mm` (on ROCm always hipBLASLt, slower than rocBLAS on
RDNA3): the self-test never offers it, so nothing the project runs may reach it."""

import importlib
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from launcher.in_trainer.selftest import blas, convolution, kernels


class Stop(Exception):
    """Raised by a stand-in to end a load once the point under test is reached."""


class AtenLog(TorchDispatchMode):
    """Every aten operator run while active, by name (catches calls from C++ as well as Python)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


class FakeBackends:
    """torch.backends.cuda.preferred_blas_library on a pretend ROCm GPU: remembers the library set."""

    def __init__(self, refuses=()):
        self.now, self.refuses, self.calls = "Cublas", refuses, []

    def __call__(self, backend=None):
        if backend is not None:
            self.calls.append(backend)
            name = str(backend)
            wanted = {"hipblas": "Cublas", "hipblaslt": "Cublaslt"}.get(name, name.split(".")[-1])
            self.now = "Cublas" if name in self.refuses else wanted
        return f"_BlasBackend.{self.now}"


# --------------------------------------------------------------------------- the trainer sets it


@pytest.mark.patch("the-self-test-s-ROCm-BLAS-library")
def test_rocm_blas_is_set_on_a_rocm_build_only(trainer_on_path, monkeypatch, capsys):
    rocm_blas = importlib.import_module("toolkit.rocm_blas")
    backends = FakeBackends()
    hip = SimpleNamespace(version=SimpleNamespace(hip="7.1"), backends=SimpleNamespace(cuda=SimpleNamespace(
        preferred_blas_library=backends)))
    assert "hipblaslt" in rocm_blas.apply({"rocm_blas": "hipblaslt"}, hip)
    assert backends.calls == ["hipblaslt"] and "hipblaslt" in capsys.readouterr().out
    refused = FakeBackends(refuses=("hipblaslt",))
    hip.backends.cuda.preferred_blas_library = refused
    assert "PyTorch keeps" in rocm_blas.apply({"rocm_blas": "hipblaslt"}, hip)
    nvidia = SimpleNamespace(version=SimpleNamespace(hip=None), backends=hip.backends)
    assert rocm_blas.apply({"rocm_blas": "hipblas"}, nvidia) is None
    assert rocm_blas.apply({}, hip) is None  # default: PyTorch's own pick
    assert refused.calls == ["hipblaslt"]
    with pytest.raises(ValueError, match="rocm_blas: auto is resolved by"):
        rocm_blas.apply({"rocm_blas": "auto"}, hip)


@pytest.mark.patch("the-self-test-s-ROCm-BLAS-library")
def test_the_flux2_model_sets_the_library_before_any_matmul(flux2_model, tiny_assets, monkeypatch, tmp_path):
    from toolkit.config_modules import ModelConfig

    seen = {}

    def apply(model_kwargs):
        seen["kwargs"], seen["ops"] = dict(model_kwargs), list(log.ops)
        raise Stop

    monkeypatch.setattr(flux2_model.rocm_blas, "apply", apply)
    config = ModelConfig(name_or_path=tiny_assets["name_or_path"], arch="flux2", quantize=True, qtype="uint4",
                         quantize_te=False, model_kwargs=dict(tiny_assets["model_kwargs"], rocm_blas="hipblas",
                                                              quantized_cache_dir=str(tmp_path / "cache")))
    model = flux2_model.Flux2Model(device="cpu", model_config=config, dtype="bf16")
    model.print_and_status_update = lambda message: None
    with AtenLog() as log, pytest.raises(Stop):
        model.load_model()
    assert seen["kwargs"]["rocm_blas"] == "hipblas"
    assert not {"mm", "addmm", "bmm", "matmul", "linear", "convolution"} & set(seen["ops"])


# --------------------------------------------------------------------------- the self-test's timing


def test_the_blas_timing_sets_each_library_times_it_and_puts_the_preference_back(monkeypatch):
    """On the CPU, against fake backends: each library timed with itself set, the pick from the
    timings, the preference as it was afterwards."""
    backends = FakeBackends()
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", backends)
    speed = {"Cublas": 3.0, "Cublaslt": 2.0}  # ms per GEMM with each library set
    timer = lambda fn: (fn(), speed[backends.now])[1]  # noqa: E731
    gemms = blas.gemm_cases([("single.linear2", 192, 64, 16, 3)])
    result = blas.measure(torch, gemms, "cpu", timer, lambda line: None)
    calls = sum(g["calls"] for g in gemms)
    assert result["step_ms"] == {"hipblas": 3.0 * calls, "hipblaslt": 2.0 * calls}
    assert result["library"] == "hipblaslt" and result["default"] == "hipblas"
    assert result["max_relative_difference"] == 0.0  # the same CPU GEMM under both names
    assert backends.calls[:2] == ["hipblas", "hipblaslt"] and backends.now == "Cublas"


def test_a_library_pytorch_refuses_on_this_gpu_is_not_timed(monkeypatch):
    backends = FakeBackends(refuses=("hipblaslt",))
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", backends)
    result = blas.measure(torch, blas.gemm_cases([("x", 128, 64, 8, 1)]), "cpu", lambda fn: (fn(), 1.0)[1],
                          lambda line: None)
    assert result["step_ms"]["hipblaslt"] is None and "does not use hipblaslt" in result["notes"]["hipblaslt"]
    assert result["library"] == "default"


def test_on_the_cpu_the_blas_and_convolution_checks_say_why_they_did_not_run():
    assert torch.cuda.is_available() is False
    skipped = blas.check(torch, True, "gfx1100", kernels.block_linear_cases(1024, 512), None, None, print)
    assert skipped["ran"] is False and skipped["library"] == "default" and "no GPU" in skipped["reason"]
    assert convolution.check(torch, None)["ran"] is False


# --------------------------------------------------------------------------- the VAE encode


@pytest.fixture
def vae_and_images(trainer_on_path, tiny_assets):
    from extensions_built_in.diffusion_models.flux2.src.autoencoder import AutoEncoder, AutoEncoderParams

    torch.manual_seed(0)
    vae = AutoEncoder(AutoEncoderParams(**tiny_assets["model_kwargs"]["ae_params"])).to(torch.bfloat16).eval()
    images = [torch.rand(3, 64, 64) * 2 - 1 for _ in range(2)]
    return vae, images


def encode_images(flux2_model, vae, images):
    """The patched Flux2Model.encode_images on a stand-in model holding only what it reads."""
    model = SimpleNamespace(vae=vae, vae_device_torch=torch.device("cpu"), vae_torch_dtype=torch.bfloat16)
    with torch.no_grad():
        return flux2_model.Flux2Model.encode_images(model, images)


def miopen_like(conv, failures: list):
    """conv's forward raising the error MIOpen gives without its JIT headers, while the vendor
    library is on (ROCm/ROCm#5941)."""
    real = conv.forward

    def forward(x):
        if torch.backends.cudnn.enabled:
            failures.append(1)
            raise RuntimeError("miopenStatusUnknownError: MIOpen(HIP): Error [Compile] HIPRTC_ERROR_COMPILATION (6)")
        return real(x)

    return forward


@pytest.mark.patch("VAE-encode-survives-a-MIOpen-failure")
def test_a_miopen_failure_in_the_encode_falls_back_to_the_same_latents(flux2_model, vae_and_images, monkeypatch,
                                                                       capsys):
    vae, images = vae_and_images
    want = encode_images(flux2_model, vae, images)
    failures = []
    monkeypatch.setattr(vae.encoder.conv_in, "forward", miopen_like(vae.encoder.conv_in, failures))
    got = encode_images(flux2_model, vae, images)
    assert failures == [1] and torch.equal(got, want)
    out = capsys.readouterr().out
    assert out.count("VAE encode: MIOpen failed") == 1 and "without MIOpen" in out
    assert torch.equal(encode_images(flux2_model, vae, images), want)  # the fallback is kept: no second failure
    assert failures == [1] and "MIOpen failed" not in capsys.readouterr().out


@pytest.mark.patch("VAE-encode-survives-a-MIOpen-failure")
def test_any_other_encode_error_is_raised_as_it_was(flux2_model, vae_and_images, monkeypatch):
    vae, images = vae_and_images

    def broken(x):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(vae.encoder.conv_in, "forward", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        encode_images(flux2_model, vae, images)


# --------------------------------------------------------------------------- no torch._int_mm


def test_the_aten_log_sees_int_mm():
    """The guard below can fail: torch._int_mm is seen when something calls it."""
    a, b = torch.ones(32, 32, dtype=torch.int8), torch.ones(32, 32, dtype=torch.int8)
    with AtenLog() as log:
        torch._int_mm(a, b)
    assert "_int_mm" in log.ops


def test_no_8bit_path_of_the_project_reaches_int_mm(trainer_on_path):
    """int4_w4a8's int8 path (reference and Triton kernels under the interpreter where Triton
    imports), every torchao qtype of the trainer's table, forward and backward: no aten._int_mm.
    The self-test offers no GEMM that routes there either (kernels.candidates, w4a8_gemm's choices)."""
    from toolkit import int4_linear
    from flux2_contract import qtypes, settings
    from toolkit.util import quantize

    assert set(settings.CATALOGUE["w4a8_gemm"].choices) == {"triton", "scaled_mm", "in_register"}
    assert {c["kernel"].get("w4a8_gemm") for c in kernels.candidates(False, True)} <= {None, "triton", "in_register"}
    log = AtenLog()
    layer = int4_linear.Int4Linear.from_linear(torch.nn.Linear(256, 128).to(torch.bfloat16))
    int4_linear.configure_linears(torch.nn.Sequential(layer), "int4_w4a8", {"w4a8_activations": "int8"}, "cpu")
    assert layer.kernel.activations == qtypes.INT8
    x = torch.randn(16, 256, dtype=torch.bfloat16, requires_grad=True)
    with log:
        layer(x).float().square().mean().backward()
    for name in quantize.torchao_qtypes:
        model = torch.nn.Sequential(torch.nn.Linear(256, 128)).to(torch.bfloat16)
        quantize.quantize(model, weights=quantize.get_qtype(name))
        with log:
            model(x).float().square().mean().backward()
    assert "mm" in log.ops or "addmm" in log.ops  # the log saw the matmuls
    assert "_int_mm" not in log.ops


def test_a_compiled_int8_block_linear_has_no_int_mm_in_inductors_code(trainer_on_path):
    """Inductor lowers aten._int_mm to hipBLASLt (or its own template): a compiled block's 4-bit
    matmul stays one opaque operator of the project, so no int_mm appears in the generated code."""
    from torch._inductor.utils import run_and_get_code

    from toolkit import int4_linear

    torch._dynamo.reset()
    layer = int4_linear.Int4Linear.from_linear(torch.nn.Linear(128, 64).to(torch.bfloat16))
    int4_linear.configure_linears(torch.nn.Sequential(layer), "int4_w4a8", {"w4a8_activations": "int8"}, "cpu")
    block = torch.nn.Sequential(torch.nn.LayerNorm(128).to(torch.bfloat16), layer, torch.nn.GELU())
    x = torch.randn(8, 128, dtype=torch.bfloat16)
    compiled = torch.compile(block, backend="inductor", fullgraph=True)
    out, code = run_and_get_code(compiled, x)
    assert code and torch.allclose(out.float(), block(x).float(), atol=2e-2, rtol=2e-2)
    assert "int4_matmul" in "".join(code) and "int_mm" not in "".join(code)

"""The fork's uses of torchao and optimum-quanto, on whatever torch the venv holds.

torchao 0.10 was built for torch 2.7 and the rocm-windows channel runs it on torch 2.13 (with
optimum-quanto 0.2.7 instead of the fork's 0.2.4): these run the fork's own quantize() with each
qtype family it routes to each package, the forward of every result against its own dequantized
weight, freeze(), the QTensor checks the fork's LoRA and optimizers make, and the imports that
need setuptools' pkg_resources, and that the venv holds the Windows channel's versions. They run
in the user-stack venv only (marker user_stack: LAUNCHER_TEST_USER_STACK holds its pins); the
targets' own venvs run these packages through the rest of the suite.
"""

import importlib
import json
import os
from importlib import metadata

import pytest
import torch

pytestmark = pytest.mark.user_stack


@pytest.fixture(scope="module")
def quantize(trainer_on_path):
    return importlib.import_module("toolkit.util.quantize")


def linear_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 128)).to(torch.bfloat16)


def dense(weight) -> torch.Tensor:
    return weight.dequantize() if hasattr(weight, "dequantize") else weight


def check_forward_matches_dequantized(model, reference):
    """The quantized model's output equals the bf16 model built from its own dequantized weights,
    and stays near the unquantized model's (4-bit: within a tenth of its scale)."""
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    rebuilt = linear_model()
    with torch.no_grad():
        for quantized, plain in ((model[0], rebuilt[0]), (model[2], rebuilt[2])):
            plain.weight.copy_(dense(quantized.weight).to(torch.bfloat16))
            plain.bias.copy_(quantized.bias)
        out, expected, unquantized = model(x).float(), rebuilt(x).float(), reference(x).float()
    assert torch.allclose(out, expected, atol=0.05, rtol=0.05), (out - expected).abs().max()
    assert (out - unquantized).abs().mean() < 0.1 * unquantized.abs().mean()


@pytest.mark.parametrize("qtype", ["uint4", "float8"])
def test_torchao_qtypes_quantize_and_run(quantize, qtype):
    model, reference = linear_model(), linear_model()
    quantize.quantize(model, weights=quantize.get_qtype(qtype))
    assert "torchao" in type(model[0].weight).__module__, type(model[0].weight)
    check_forward_matches_dequantized(model, reference)


@pytest.mark.parametrize("qtype", ["qint8", "qint4", "qfloat8"])
def test_quanto_qtypes_quantize_freeze_and_run(quantize, qtype):
    from optimum.quanto import QBytesTensor, QTensor, freeze

    model, reference = linear_model(), linear_model()
    quantize.quantize(model, weights=quantize.get_qtype(qtype))
    freeze(model)
    assert isinstance(model[0].weight, QTensor), type(model[0].weight)
    assert isinstance(model[0].weight, QBytesTensor) == (qtype != "qint4")
    check_forward_matches_dequantized(model, reference)


def test_the_imports_that_need_pkg_resources(trainer_on_path):
    """clip (k-diffusion's) reads `pkg_resources.packaging`; pytorch_wavelets' dtcwt `resource_stream`."""
    importlib.import_module("clip")
    importlib.import_module("pytorch_wavelets.dtcwt.coeffs")
    importlib.import_module("toolkit.pipelines")  # k_diffusion, as the trainer imports it


def test_the_user_stack_holds_the_windows_channel_versions():
    pins = json.loads(os.environ["LAUNCHER_TEST_USER_STACK"])
    assert {name: metadata.version(name).split("+", 1)[0] for name in pins} == pins

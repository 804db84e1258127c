"""Quantizing with a torchao qtype leaves the process's Inductor settings and float32 matmul
precision as they were (wall 11). torchao's quantize_ would set them for the whole process
(coordinate-descent tuning, TF32 matmuls): a first launch, which quantizes, then compiled the
blocks with other settings than a relaunch, which loads the quantized cache."""

import importlib

import pytest
import torch
import torch._inductor.config as inductor

pytestmark = pytest.mark.patch("torchao-s-configs-leave-Inductor")

SETTINGS = ("coordinate_descent_tuning", "coordinate_descent_check_all_directions", "force_fuse_int_mm_with_mul")


def settings() -> dict:
    return {**{name: getattr(inductor, name) for name in SETTINGS},
            "triton.unique_kernel_names": inductor.triton.unique_kernel_names,
            "float32_matmul_precision": torch.get_float32_matmul_precision()}


@pytest.fixture
def defaults(monkeypatch):
    """Inductor's settings off and float32 matmuls at full precision, as a run starts."""
    for name in SETTINGS:
        monkeypatch.setattr(inductor, name, False)
    monkeypatch.setattr(inductor.triton, "unique_kernel_names", False)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield settings()
    torch.set_float32_matmul_precision(precision)


def test_quantizing_with_each_torchao_qtype_leaves_inductor_and_tf32_alone(trainer_on_path, defaults):
    quantize = importlib.import_module("toolkit.util.quantize")
    quantized = []
    for name in quantize.torchao_qtypes:
        model = torch.nn.Sequential(torch.nn.Linear(256, 256)).to(torch.bfloat16)
        quantize.quantize(model, weights=quantize.get_qtype(name))
        assert settings() == defaults, name
        if "torchao" in type(model[0].weight).__module__:
            quantized.append(name)
    assert quantized, "no torchao qtype quantized a Linear on this machine"

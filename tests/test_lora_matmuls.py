"""model_kwargs lora_matmuls: the precision of the LoRA's float32 matmuls, which `run` hands the
trainer as PyTorch's TF32 override (launcher/runs/trainer_env.py FROM_SETTINGS)."""

import os
import subprocess

import pytest

from flux2_contract import settings
from launcher import resolve
from launcher.envs.workdir import venv_python
from launcher.runs import trainer_env

OVERRIDE = "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"


def resolved_env(**kwargs) -> dict:
    """The variables `run` gives the trainer for one process with these model_kwargs, after the
    catalogue's defaults are filled in as `run` fills them."""
    config = {"config": {"process": [{"model": {"qtype": "int4_w4a8", "model_kwargs": resolve.concrete(kwargs)}}]}}
    return trainer_env.from_settings(config)


def test_tf32_sets_the_override_and_fp32_leaves_it_unset():
    assert resolved_env(lora_matmuls="tf32") == {OVERRIDE: "1"}
    assert OVERRIDE not in resolved_env(lora_matmuls="fp32")


def test_unset_takes_the_catalogues_default():
    default = settings.CATALOGUE["lora_matmuls"].default
    assert (OVERRIDE in resolved_env()) == (default == "tf32")


def test_another_value_is_refused_with_what_is_allowed():
    setting = settings.CATALOGUE["lora_matmuls"]
    assert setting.problem("fp16") and setting.values == "bf16 | tf32 | fp32"


@pytest.mark.trainer
def test_the_override_turns_pytorchs_tf32_on_in_the_process_it_starts(trainer_workdir):
    """What the variable does, in a fresh interpreter of the trainer's venv as the trainer is one:
    PyTorch starts with TF32 for its float32 matmuls (the trainer never sets the precision itself)."""
    probe = "import torch; print(torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())"
    python = str(venv_python(trainer_workdir.venv))
    reported = {}
    for value in ("1", None):
        env = {key: item for key, item in os.environ.items() if key != OVERRIDE}
        if value:
            env[OVERRIDE] = value
        out = subprocess.run([python, "-c", probe], env=env, capture_output=True, text=True, check=True)
        reported[value] = out.stdout.strip()
    assert reported == {"1": "True high", None: "False highest"}

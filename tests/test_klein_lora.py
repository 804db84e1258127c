"""A FLUX.2 klein LoRA is checked as ComfyUI loads it: against klein's own checkpoint, the one the
trainer read from the run's model folder, so a LoRA of FLUX.2 [dev] is named as not fitting."""

from pathlib import Path

import pytest
from test_comfy import write_safetensors

from flux2_contract.families import KLEIN_4B, KLEIN_9B
from launcher.comfy import lora_check
from launcher.errors import LauncherError

KLEIN = {family.arch: family for family in (KLEIN_4B, KLEIN_9B)}

MODULES = ("double_blocks.0.img_attn.qkv", "double_blocks.0.img_attn.proj", "single_blocks.0.linear2")


def linear_shapes(hidden: int) -> dict[str, list[int]]:
    """The three Linears of MODULES at a hidden size, as the Flux2 module tree names and shapes them."""
    return {"double_blocks.0.img_attn.qkv": [3 * hidden, hidden], "double_blocks.0.img_attn.proj": [hidden, hidden],
            "single_blocks.0.linear2": [hidden, 4 * hidden]}


def lora(path: Path, hidden: int, rank: int = 4) -> Path:
    shapes = {}
    for module, (out_features, in_features) in linear_shapes(hidden).items():
        shapes[f"diffusion_model.{module}.lora_A.weight"] = [rank, in_features]
        shapes[f"diffusion_model.{module}.lora_B.weight"] = [out_features, rank]
    return write_safetensors(path, shapes)


@pytest.mark.parametrize("arch", sorted(KLEIN))
def test_the_base_of_a_klein_run_is_klein_s_checkpoint(tmp_path, arch):
    assert lora_check.base_checkpoint(str(tmp_path), arch) == tmp_path / KLEIN[arch].transformer_file
    assert lora_check.base_checkpoint(str(tmp_path), "flux2") == tmp_path / "flux2-dev.safetensors"
    assert lora_check.base_checkpoint(str(tmp_path / "x.safetensors"), arch) == tmp_path / "x.safetensors"


@pytest.mark.parametrize("arch", sorted(KLEIN))
def test_a_klein_lora_fits_its_base_and_a_dev_lora_does_not(tmp_path, arch):
    hidden = KLEIN[arch].shape["hidden_size"]
    base = write_safetensors(lora_check.base_checkpoint(str(tmp_path / "model"), arch),
                             {f"{module}.weight": shape for module, shape in linear_shapes(hidden).items()})
    summary = lora_check.check_lora(lora(tmp_path / "klein.safetensors", hidden), base)
    assert (summary.modules, summary.tensors, summary.ranks) == (3, 6, (4,))
    with pytest.raises(LauncherError, match=r"does not fit the FLUX.2 transformer .* in 3 of 3 modules"):
        lora_check.check_lora(lora(tmp_path / "dev.safetensors", 6144), base)


def test_a_klein_run_without_its_checkpoint_names_the_klein_file(tmp_path):
    base = lora_check.base_checkpoint(str(tmp_path), "flux2_klein_9b")
    with pytest.raises(LauncherError, match="flux-2-klein-base-9b.safetensors is missing"):
        lora_check.check_lora(lora(tmp_path / "klein.safetensors", 4096), base)

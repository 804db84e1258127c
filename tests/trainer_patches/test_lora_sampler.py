"""toolkit/lora_sampler.py on the embedded tiny FLUX.2 (4-bit base, CPU): images that are not black.

Wall 6: 4-bit previews came out black, which is what a NaN or inf in the decoded image gives.
The model loads once per module the way `launcher sample` loads it (the trainer's own
load_model: quantized uint4 base, text phase); a rank-4 LoRA with random, non-zero factors on
three block Linears makes strength 0 and 1 differ. 128 px and 3 steps keep it a few seconds.
"""

import pytest
import torch
from conftest import is_quantized_linear

PROMPTS = ["a photo of a red square on a white background", "a blue circle"]
SIZE, STEPS = 128, 3
LORA_MODULES = ["double_blocks.0.img_attn.qkv", "double_blocks.0.img_mlp.0", "single_blocks.0.linear1"]


@pytest.fixture(scope="module")
def sampler(trainer_on_path):
    from toolkit import lora_sampler

    return lora_sampler


@pytest.fixture(scope="module")
def model(sampler, tiny_assets, tmp_path_factory):
    folder = tmp_path_factory.mktemp("sample-run")
    config = dict(name_or_path=tiny_assets["name_or_path"], arch="flux2", quantize=True, qtype="uint4",
                  low_vram=True, layer_offloading=False,
                  model_kwargs=dict(tiny_assets["model_kwargs"], quantized_cache_dir=str(folder / "qcache"),
                                    text_embedding_cache_dir=str(folder / "text")))
    return sampler.load_model(config, "bf16", PROMPTS, str(folder), device="cpu")


@pytest.fixture(scope="module")
def lora(model):
    """A rank-4 LoRA of three block Linears, both factors random (a trained one is near zero after 2 steps)."""
    generator = torch.Generator().manual_seed(3)
    modules = dict(model.transformer.named_modules())
    tensors = {}
    for name in LORA_MODULES:
        out_features, in_features = modules[name].out_features, modules[name].in_features
        tensors[f"diffusion_model.{name}.lora_A.weight"] = torch.randn(4, in_features, generator=generator) * 0.5
        tensors[f"diffusion_model.{name}.lora_B.weight"] = torch.randn(out_features, 4, generator=generator) * 0.5
    return tensors


def test_the_base_is_4_bit(model):
    qkv = dict(model.transformer.named_modules())["double_blocks.0.img_attn.qkv"]
    assert is_quantized_linear(qkv), "the test must sample a quantized base"


def test_images_are_finite_not_constant_and_the_lora_strength_shows(sampler, model, lora, tmp_path):
    hooks = sampler.attach_lora(model.transformer, lora, model.device_torch, model.torch_dtype)
    try:
        request = sampler.SampleRequest(PROMPTS, [0.0, 1.0], seed=7, size=SIZE, steps=STEPS, out_dir=tmp_path)
        written = sampler.sample_grid(model, hooks, request, log=lambda _: None)
        embeds = model.text_embeddings.get(PROMPTS[:1])
        hooks.strength = 0.0
        base = sampler.denoise(model, embeds, SIZE, STEPS, seed=7)
        again = sampler.denoise(model, embeds, SIZE, STEPS, seed=7)
        other_seed = sampler.denoise(model, embeds, SIZE, STEPS, seed=8)
        hooks.strength = 1.0
        with_lora = sampler.denoise(model, embeds, SIZE, STEPS, seed=7)
    finally:
        hooks.remove()
    assert [p.name for p in written] == ["p0_s0.png", "p0_s1.png", "p1_s0.png", "p1_s1.png", "contact_sheet.png"]
    for image in (base, with_lora):
        assert image.shape == (3, SIZE, SIZE) and bool(torch.isfinite(image).all())
        assert float(image.std()) > 0.01, "a constant image (black, when NaN was cast to 8 bits)"
    assert torch.equal(base, again), "the same seed must give the same image"
    assert not torch.equal(base, other_seed)
    assert float((base - with_lora).abs().mean()) > 1e-3, "strength 0 and 1 gave the same image"
    from PIL import Image

    sheet = Image.open(tmp_path / "contact_sheet.png")
    assert sheet.size == (2 * SIZE + sampler.SHEET_GAP, 2 * SIZE + sampler.SHEET_GAP)
    assert max(Image.open(written[1]).convert("L").getextrema()) > 0, "an all-black PNG"


def test_hooks_removed_give_the_base_model_back(sampler, model, lora):
    embeds = model.text_embeddings.get(PROMPTS[:1])
    before = sampler.denoise(model, embeds, SIZE, STEPS, seed=1)
    sampler.attach_lora(model.transformer, lora, model.device_torch, model.torch_dtype).remove()
    assert torch.equal(before, sampler.denoise(model, embeds, SIZE, STEPS, seed=1))


def test_a_non_finite_prediction_is_stopped_with_its_step(sampler, model):
    """What a black preview was: the sample stops and names the step instead of writing black."""
    block = dict(model.transformer.named_modules())["single_blocks.0.linear2"]
    handle = block.register_forward_hook(lambda module, inputs, output: output * float("nan"))
    try:
        with pytest.raises(sampler.NonFiniteSample, match=r"prediction at step 1 of 3"):
            sampler.denoise(model, model.text_embeddings.get(PROMPTS[:1]), SIZE, STEPS, seed=1)
    finally:
        handle.remove()


def test_a_lora_of_another_model_is_refused(sampler, model):
    with pytest.raises(ValueError, match="does not have"):
        sampler.attach_lora(model.transformer, {"diffusion_model.double_blocks.9.img_attn.qkv.lora_A.weight": torch.zeros(4, 64),
                                                "diffusion_model.double_blocks.9.img_attn.qkv.lora_B.weight": torch.zeros(192, 4)},
                            model.device_torch, model.torch_dtype)

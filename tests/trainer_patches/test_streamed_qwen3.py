"""FLUX.2 klein's Qwen3 encoder through the streamed text encoder (overlay
toolkit/streamed_text_encoder.py, its Qwen3 family) with klein's own prompt template
(Flux2KleinModel.prompt_template): the hidden states are those of the pipeline's
_get_qwen_prompt_embeds with the whole bf16 Qwen3ForCausalLM, each layer read once, the
embedding table never whole; a Qwen3 too shallow for klein's stacked states is refused by name."""

import importlib
import json
import shutil

import pytest
import torch

pytestmark = pytest.mark.trainer_has("extensions_built_in/diffusion_models/flux2/flux2_klein_model.py")

PROMPTS = ["a photo of a red square on a white background", "", "a blue circle", "speculation " * 600]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from launcher.in_trainer import tiny_assets

    return tiny_assets.build_qwen3_encoder(tmp_path_factory.mktemp("tiny-qwen3") / "qwen3", seed=0)


@pytest.fixture(scope="module")
def modules(trainer_on_path):
    pipeline = importlib.import_module("extensions_built_in.diffusion_models.flux2.src.pipeline")
    klein = importlib.import_module("extensions_built_in.diffusion_models.flux2.flux2_klein_model")
    ste = importlib.import_module("toolkit.streamed_text_encoder")
    return pipeline, ste, klein.Flux2Klein4BModel.prompt_template(None)


@pytest.fixture(scope="module")
def reference(modules, qwen3):
    """The pipeline's klein prompt path with the whole encoder as klein's load_te loads it."""
    pipeline, _, _ = modules
    from types import SimpleNamespace

    from transformers import Qwen2Tokenizer, Qwen3ForCausalLM

    pipe = SimpleNamespace(tokenizer=Qwen2Tokenizer.from_pretrained(qwen3), _execution_device="cpu",
                           text_encoder=Qwen3ForCausalLM.from_pretrained(qwen3, dtype=torch.bfloat16))
    with torch.no_grad():
        return torch.cat([pipeline.Flux2Pipeline._get_qwen_prompt_embeds(pipe, [p], "cpu")[0] for p in PROMPTS])


def test_the_template_is_the_pipeline_s(modules):
    pipeline, _, template = modules
    assert template.hidden_layers == tuple(pipeline.OUTPUT_LAYERS_QWEN3)
    assert template.max_length == 512
    assert template.key()["chat_options"] == {"add_generation_prompt": True, "enable_thinking": False}


def test_streamed_qwen3_states_are_the_whole_encoder_s(modules, qwen3, reference, monkeypatch):
    _, ste, template = modules
    reads = []
    real_read = ste.StreamedSafetensors.read
    monkeypatch.setattr(ste.StreamedSafetensors, "read", lambda self, name: reads.append(name) or real_read(self, name))
    encoder = ste.open_encoder(qwen3, max(template.hidden_layers))
    assert encoder.family.model_type == "qwen3"
    out = ste.StreamedTextEncoder(encoder, template, "cpu", log=lambda message: None, micro_batch=3).encode(PROMPTS)
    assert out.shape == reference.shape == (len(PROMPTS), 512, 3 * encoder.hidden_size)
    assert torch.equal(out, reference)
    assert not any(name.endswith("embed_tokens.weight") for name in reads)
    layers = [int(name.split(".layers.")[1].split(".")[0]) for name in reads if ".layers." in name]
    assert sorted(set(layers)) == list(range(27)) and len(layers) == 27 * 11  # q_norm and k_norm too


def test_a_qwen3_too_shallow_for_klein_is_refused(modules, qwen3, tmp_path):
    _, ste, template = modules
    folder = tmp_path / "shallow"
    shutil.copytree(qwen3, folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 20
    config.pop("layer_types", None)  # one per layer where transformers writes them
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ste.TextEncoderFolderError, match=r"hidden state 27 but the encoder has 20 layers"):
        ste.open_encoder(folder, max(template.hidden_layers))

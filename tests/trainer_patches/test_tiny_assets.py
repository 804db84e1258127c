"""The tiny FLUX.2 builders: dataset, tokenizer and chat template, offline text encoder."""

import torch
import transformers

from launcher.in_trainer import tiny_assets as tiny


def test_dataset_is_captioned_and_deterministic(tmp_path):
    first = tiny.build_dataset(tmp_path / "a", seed=3)
    second = tiny.build_dataset(tmp_path / "b", seed=3)
    images = sorted(first.glob("*.png"))
    assert len(images) == tiny.IMAGE_COUNT
    for image in images:
        caption = image.with_suffix(".txt").read_text(encoding="utf-8")
        assert caption.startswith("a photo of")
        assert image.read_bytes() == (second / image.name).read_bytes()


def test_chat_template_uses_control_tokens_and_known_words():
    tokenizer = tiny.build_tokenizer()
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "You give structured responses."}]},
        {"role": "user", "content": [{"type": "text", "text": "a red circle on a black background"}]},
    ]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert tokens[0] == "<s>"
    assert "[SYSTEM_PROMPT]" in tokens and "[INST]" in tokens and "[/INST]" in tokens
    assert "<unk>" not in tokens


def test_text_encoder_folder_loads_offline_and_gives_layer_30(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tiny.build_text_encoder(tmp_path, seed=0)
    processor = transformers.AutoProcessor.from_pretrained(folder)
    model = transformers.Mistral3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    messages = [[{"role": "user", "content": [{"type": "text", "text": "a photo"}]}]]
    inputs = processor.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_tensors="pt",
        padding="max_length", truncation=True, max_length=16,
    )
    assert inputs["input_ids"].shape == (1, 16)
    with torch.no_grad():
        output = model(**inputs, output_hidden_states=True, use_cache=False)
    assert output.hidden_states[30].shape == (1, 16, tiny.TE_HIDDEN)

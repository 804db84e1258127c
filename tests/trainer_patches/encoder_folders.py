"""Text encoder folders for the text-phase tests: the tiny FLUX.2's Mistral3, resaved in shards,
and random-weight encoders of a chosen depth and width written tensor by tensor."""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "processor_config.json", "preprocessor_config.json")
LAYER_SHAPES = {
    "input_layernorm.weight": lambda h, i, q, kv: (h,),
    "post_attention_layernorm.weight": lambda h, i, q, kv: (h,),
    "self_attn.q_proj.weight": lambda h, i, q, kv: (q, h),
    "self_attn.k_proj.weight": lambda h, i, q, kv: (kv, h),
    "self_attn.v_proj.weight": lambda h, i, q, kv: (kv, h),
    "self_attn.o_proj.weight": lambda h, i, q, kv: (h, q),
    "mlp.gate_proj.weight": lambda h, i, q, kv: (i, h),
    "mlp.up_proj.weight": lambda h, i, q, kv: (i, h),
    "mlp.down_proj.weight": lambda h, i, q, kv: (h, i),
}


def resave_sharded(source: Path, out: Path, max_shard_size: str = "200KB") -> Path:
    """The same Mistral3 saved by transformers across many shards with an index."""
    from transformers import AutoProcessor, Mistral3ForConditionalGeneration

    model = Mistral3ForConditionalGeneration.from_pretrained(source, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    AutoProcessor.from_pretrained(source).save_pretrained(out)
    assert (out / "model.safetensors.index.json").is_file()
    return out


def write_random_encoder(out: Path, tokenizer_from: Path, layers: int, hidden: int, intermediate: int,
                         heads: int = 8, kv_heads: int = 2, seed: int = 0) -> Path:
    """A Mistral3 folder (config, tokenizer, language-model weights only) of random bf16 weights,
    one shard per layer, written without ever holding the whole model."""
    from transformers import Mistral3Config, MistralConfig, PixtralVisionConfig

    out.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, out / name)
    vocab = json.loads((tokenizer_from / "config.json").read_text())["text_config"]["vocab_size"]
    head_dim = hidden // heads
    text = MistralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, max_position_embeddings=1024, sliding_window=None, pad_token_id=3)
    Mistral3Config(text_config=text, vision_config=PixtralVisionConfig(hidden_size=64, num_hidden_layers=1,
                   num_attention_heads=1, head_dim=64, intermediate_size=128)).to_json_file(out / "config.json")
    generator = torch.Generator().manual_seed(seed)
    prefix = "language_model.model."
    weight_map = {}

    def shard(name: str, tensors: dict):
        save_file(tensors, str(out / name))
        weight_map.update({key: name for key in tensors})

    def random(*shape):
        scale = 1.0 if len(shape) == 1 else shape[1] ** -0.5
        return (torch.randn(*shape, generator=generator) * scale).to(torch.bfloat16)

    shard("embed.safetensors", {prefix + "embed_tokens.weight": random(vocab, hidden),
                                prefix + "norm.weight": random(hidden)})
    q, kv = heads * head_dim, kv_heads * head_dim
    # one random layer, written under every index: drawing each anew is slow and tests no more
    layer = {name: random(*shape(hidden, intermediate, q, kv)) for name, shape in LAYER_SHAPES.items()}
    for index in range(layers):
        shard(f"layer-{index:03d}.safetensors", {f"{prefix}layers.{index}.{name}": t for name, t in layer.items()})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out

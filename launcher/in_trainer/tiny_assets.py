"""The embedded tiny FLUX.2: random-weight stand-ins for every file a FLUX.2 run loads.

The real model needs ~110 GB of downloads and a GPU; this builds, from a seed and in seconds,
files with the same formats and the same code paths (transformer and VAE single-file
checkpoints, a Mistral3 text encoder folder with its own processor and tokenizer, a captioned
image dataset), so the whole patched trainer can be exercised offline on a CPU.

It runs under the TRAINER's interpreter, because the transformer and VAE are the fork's own
Flux2 and AutoEncoder classes: `python -m launcher.in_trainer.tiny_assets --trainer DIR --out DIR
--seed 0`. Heavy imports stay inside the builders so that the launcher, in a bare interpreter,
can import the constants. The manifest names files relative to its own folder, so a workdir
still works after it is moved or copied.

Shapes follow the constraints of the FLUX.2 code and of 4-bit quantization:
- the pipeline stacks Mistral hidden states 10, 20 and 30, so the encoder has 30 layers and the
  transformer's context width is 3 x the encoder's hidden size;
- the pipeline hard-codes a VAE scale factor of 16 and 128 latent channels: z_channels 32
  (x 2x2 pixel shuffle) with a 4-level ch_mult;
- GroupNorm(32) in the VAE needs widths that are multiples of 32;
- the rotary axes must sum to hidden_size / num_heads;
- torchao uint4 needs Linear input widths that are multiples of 64.
"""

import argparse
import dataclasses
import json
import random
import sys
from pathlib import Path

from flux2_contract.families import FLUX2_DEV, KLEIN_4B

ASSETS_FORMAT = 2
"""Bump when the assets change shape, so existing workdirs rebuild them."""

DEFAULT_SEED = 0
MANIFEST_NAME = "manifest.json"
TRANSFORMER_FILE = FLUX2_DEV.transformer_file
VAE_FILE = "ae.safetensors"
TEXT_ENCODER_DIR = "text_encoder"
DATASET_DIR = "dataset"

TE_HIDDEN = 64
TE_LAYERS = 30
FLUX2_PARAMS = {
    "in_channels": 128,
    "context_in_dim": 3 * TE_HIDDEN,
    "hidden_size": 64,
    "num_heads": 2,
    "depth": 1,
    "depth_single_blocks": 1,
    "axes_dim": [8, 8, 8, 8],
    "theta": 2000,
    "mlp_ratio": 3.0,
}
AE_PARAMS = {
    "resolution": 256,
    "in_channels": 3,
    "ch": 32,
    "out_ch": 3,
    "ch_mult": [1, 1, 1, 1],
    "num_res_blocks": 1,
    "z_channels": 32,
}
IMAGE_SIZE = 128
IMAGE_COUNT = 4

SPECIAL_TOKENS = [
    "<unk>", "<s>", "</s>", "<pad>",
    "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
    "[IMG]", "[IMG_BREAK]", "[IMG_END]",
]
# Words of the pipeline's system message and of the captions, so that prompts do not
# tokenize to a run of <unk>; anything else maps to <unk>, which is harmless here.
WORDS = (
    "you are an ai that reasons about image descriptions . give structured responses "
    "focusing on object relationships , attribution and actions without speculation "
    "a photo of red green blue yellow square circle on white black background"
).split()
# Mistral's template, reduced to the roles the FLUX.2 pipeline sends.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['content'] is string %}{% set parts = [{'type': 'text', 'text': message['content']}] %}"
    "{% else %}{% set parts = message['content'] %}{% endif %}"
    "{% for part in parts %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ part['text'] }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{{ part['text'] }}[/INST]"
    "{% else %}{{ part['text'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}{% endfor %}"
)
KLEIN_TRANSFORMER_FILE = KLEIN_4B.transformer_file
KLEIN_TEXT_ENCODER_DIR = "qwen3"
KLEIN_TE_LAYERS = 27
"""klein stacks Qwen3 hidden states 9, 18 and 27 (OUTPUT_LAYERS_QWEN3 in its pipeline), so the
encoder needs 27 layers; at the same width as the tiny Mistral the transformer's context width
(3 x 64) and so FLUX2_PARAMS fit klein too. klein's own difference, no guidance embedding, comes
from the trainer's Klein4BParams, which FLUX2_PARAMS only reshapes."""
QWEN_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# Qwen3's template, reduced to what the klein pipeline sends: one user turn, a generation prompt,
# and the empty thinking block that `enable_thinking=False` asks for.
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}
BACKGROUNDS = {"white": (245, 245, 245), "black": (15, 15, 15)}


MANIFEST_BYTES = 2**20
"""A manifest is a few hundred bytes; a larger file is not one (and is never read whole)."""


def read_manifest(out: Path, seed: int) -> dict | None:
    """The manifest of assets built in `out` from `seed` in this format, or None if stale or absent."""
    path = out / MANIFEST_NAME
    try:
        if not path.is_file() or path.stat().st_size > MANIFEST_BYTES:  # a FIFO, a device, a planted giant
            return None
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # RecursionError: JSON nested thousands of levels deep
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != ASSETS_FORMAT or manifest.get("seed") != seed:
        return None
    return manifest


def build_dataset(out: Path, seed: int, size: int = IMAGE_SIZE, count: int = IMAGE_COUNT) -> Path:
    """Solid shapes on plain backgrounds, each PNG with a matching .txt caption."""
    from PIL import Image, ImageDraw

    folder = out / DATASET_DIR
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for index in range(count):
        color = rng.choice(sorted(COLORS))
        background = rng.choice(sorted(BACKGROUNDS))
        shape = rng.choice(["square", "circle"])
        image = Image.new("RGB", (size, size), BACKGROUNDS[background])
        left, top = rng.randrange(0, size // 2), rng.randrange(0, size // 2)
        box = (left, top, left + size // 2, top + size // 2)
        draw = ImageDraw.Draw(image)
        (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=COLORS[color])
        image.save(folder / f"image_{index:03d}.png")
        caption = f"a photo of a {color} {shape} on a {background} background"
        (folder / f"image_{index:03d}.txt").write_text(caption, encoding="utf-8")
    return folder


def build_tokenizer():
    """A word-level fast tokenizer with Mistral's control tokens, built offline."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for word in sorted(set(WORDS)):
        vocab[word] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
    )


def build_text_encoder(out: Path, seed: int, **sizes) -> Path:
    """A 30-layer, 64-wide Mistral3 with a Pixtral processor, saved as a from_pretrained folder."""
    import torch
    from transformers import Mistral3ForConditionalGeneration

    folder = out / TEXT_ENCODER_DIR
    tokenizer = build_tokenizer()
    save_processor(folder, tokenizer)
    torch.manual_seed(seed)
    model = Mistral3ForConditionalGeneration(text_encoder_config(tokenizer, **sizes)).to(torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def text_encoder_config(tokenizer, **sizes):
    """The tiny Mistral3's config; `sizes` override the text model's shape (the full-size
    benchmark writes the real Mistral-Small-3.1 text shape with its own streamed writer)."""
    from transformers import Mistral3Config, MistralConfig, PixtralVisionConfig

    shape = {
        "vocab_size": len(tokenizer),
        "hidden_size": TE_HIDDEN,
        "intermediate_size": 2 * TE_HIDDEN,
        "num_hidden_layers": TE_LAYERS,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": TE_HIDDEN // 2,
        "max_position_embeddings": 1024,
    }
    text_config = MistralConfig(
        **{**shape, **sizes},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision_config = PixtralVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=1,
        head_dim=64,
        patch_size=16,
        image_size=64,
    )
    return Mistral3Config(
        text_config=text_config,
        vision_config=vision_config,
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=2,
    )


def save_processor(folder: Path, tokenizer) -> None:
    from transformers import PixtralImageProcessor, PixtralProcessor

    processor = PixtralProcessor(
        image_processor=PixtralImageProcessor(
            size={"longest_edge": 64}, patch_size={"height": 16, "width": 16}
        ),
        tokenizer=tokenizer,
        patch_size=16,
        spatial_merge_size=2,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(folder)


def build_checkpoints(trainer: Path, out: Path, seed: int) -> None:
    """Single-file transformer and VAE checkpoints from the fork's own FLUX.2 classes."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(trainer))
    from extensions_built_in.diffusion_models.flux2.src.autoencoder import (
        AutoEncoder,
        AutoEncoderParams,
    )
    from extensions_built_in.diffusion_models.flux2.src.model import Flux2, Flux2Params

    for path, module_class, params in (
        (out / TRANSFORMER_FILE, Flux2, Flux2Params(**FLUX2_PARAMS)),
        (out / VAE_FILE, AutoEncoder, AutoEncoderParams(**AE_PARAMS)),
    ):
        torch.manual_seed(seed)
        state = module_class(params).to(torch.bfloat16).state_dict()
        save_file({key: value.contiguous() for key, value in state.items()}, str(path))


def build_qwen3_encoder(folder: Path, seed: int) -> Path:
    """A 27-layer, 64-wide Qwen3 with a byte-level tokenizer (one token a byte, no merges): a
    from_pretrained folder for Qwen3ForCausalLM and Qwen2Tokenizer, as klein loads its encoder."""
    import torch
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3ForCausalLM

    vocab = {token: index for index, token in enumerate(QWEN_SPECIAL_TOKENS)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(char, len(vocab))
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], chat_template=QWEN_CHAT_TEMPLATE,
                               additional_special_tokens=QWEN_SPECIAL_TOKENS[1:])
    tokenizer.save_pretrained(folder)
    config = Qwen3Config(vocab_size=len(vocab), hidden_size=TE_HIDDEN, intermediate_size=2 * TE_HIDDEN,
                         num_hidden_layers=KLEIN_TE_LAYERS, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=TE_HIDDEN // 2, max_position_embeddings=1024,
                         pad_token_id=vocab["<|endoftext|>"], eos_token_id=vocab["<|im_end|>"])
    torch.manual_seed(seed)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return folder


def build_klein(trainer: Path, out: Path, seed: int) -> dict:
    """The tiny FLUX.2 klein 4B in `out` (transformer, VAE, Qwen3 encoder, dataset) unless it exists
    for this seed; return its manifest, written last like the tiny FLUX.2's."""
    import torch
    from safetensors.torch import save_file

    manifest = read_manifest(out, seed)
    if manifest is not None:
        return manifest
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    build_checkpoints(trainer, out, seed)  # the VAE, and a FLUX.2 transformer that klein's file replaces
    from extensions_built_in.diffusion_models.flux2.src.model import Flux2, Klein4BParams

    torch.manual_seed(seed)
    state = Flux2(dataclasses.replace(Klein4BParams(), **FLUX2_PARAMS)).to(torch.bfloat16).state_dict()
    save_file({key: value.contiguous() for key, value in state.items()}, str(out / KLEIN_TRANSFORMER_FILE))
    (out / TRANSFORMER_FILE).unlink()
    build_qwen3_encoder(out / KLEIN_TEXT_ENCODER_DIR, seed)
    build_dataset(out, seed)
    manifest = {"format": ASSETS_FORMAT, "seed": seed, "name_or_path": ".", "dataset": DATASET_DIR,
                "resolution": IMAGE_SIZE, "arch": KLEIN_4B.arch,
                "model_kwargs": {"flux2_params": FLUX2_PARAMS, "ae_params": AE_PARAMS,
                                 "text_encoder_path": KLEIN_TEXT_ENCODER_DIR}}
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    return manifest


def build(trainer: Path, out: Path, seed: int) -> dict:
    """Build the assets in `out` unless they already exist for this seed; return the manifest.

    The manifest is written last, so an interrupted build is redone on the next call.
    """
    manifest = read_manifest(out, seed)
    if manifest is not None:
        return manifest
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    build_checkpoints(trainer, out, seed)
    build_text_encoder(out, seed)
    build_dataset(out, seed)
    manifest = {
        "format": ASSETS_FORMAT,
        "seed": seed,
        "name_or_path": ".",
        "dataset": DATASET_DIR,
        "resolution": IMAGE_SIZE,
        "model_kwargs": {
            "flux2_params": FLUX2_PARAMS,
            "ae_params": AE_PARAMS,
            "text_encoder_path": TEXT_ENCODER_DIR,
        },
    }
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    return manifest


BUILDERS = {"flux2": (build, "FLUX.2"), "klein_4b": (build_klein, "FLUX.2 klein")}
"""Each builder a family's tiny recipe may name (flux2_contract/families.py TinyRecipe.builder), with what it
builds."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.in_trainer.tiny_assets", description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", type=Path, required=True, help="the trainer checkout (for Flux2/AutoEncoder)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the assets")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--builder", choices=sorted(BUILDERS), default="flux2",
                        help="which tiny model: flux2 (FLUX.2), klein_4b (FLUX.2 klein 4B, a trainer with klein)")
    args = parser.parse_args(argv)
    builder, what = BUILDERS[args.builder]
    builder(args.trainer, args.out, args.seed)
    print(f"tiny {what} assets ready in {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

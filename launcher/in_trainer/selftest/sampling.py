"""The self-test's sampling check: does sampling complete on this GPU, with finite images?

Wall 6: in-training sampling deadlocked the HIP driver on Windows and 4-bit previews came out
black. This loads the embedded tiny FLUX.2 the way `launcher sample` does (the trainer's
load_model, a 4-bit base, the text phase), adds a rank-4 LoRA with random factors, and samples
one prompt at strengths 0 and 1 on the GPU (the CPU without one). The launcher runs it in a
process of its own with a time limit: a deadlock is a timeout there, not a hung self-test.
Writes one JSON object: passed, device, seconds, and the error when it failed.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

from flux2_contract.families import FLUX2_DEV

PROMPT = "a photo of a red square on a white background"
SIZE, STEPS, SEED, RANK = 128, 4, 42, 4
LORA_MODULES = ("double_blocks.0.img_attn.qkv", "single_blocks.0.linear1")


def random_lora(torch, transformer) -> dict:
    generator = torch.Generator().manual_seed(SEED)
    modules = dict(transformer.named_modules())
    tensors = {}
    for name in LORA_MODULES:
        linear = modules[name]
        tensors[f"diffusion_model.{name}.lora_A.weight"] = torch.randn(RANK, linear.in_features, generator=generator) / 2
        tensors[f"diffusion_model.{name}.lora_B.weight"] = torch.randn(linear.out_features, RANK, generator=generator) / 2
    return tensors


def check(trainer: Path, assets: dict, out: Path) -> dict:
    import torch
    from toolkit import lora_sampler

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = dict(name_or_path=assets["name_or_path"], arch=FLUX2_DEV.arch, quantize=True, qtype="uint4", low_vram=True,
                  layer_offloading=False, model_kwargs=dict(assets["model_kwargs"]))
    start = time.perf_counter()
    model = lora_sampler.load_model(config, "bf16", [PROMPT], str(out), device=device)
    hooks = lora_sampler.attach_lora(model.transformer, random_lora(torch, model.transformer),
                                     model.device_torch, model.torch_dtype)
    embeds = model.text_embeddings.get([PROMPT])
    images = []
    for strength in (0.0, 1.0):
        hooks.strength = strength
        images.append(lora_sampler.denoise(model, embeds, SIZE, STEPS, SEED))
    if device == "cuda":
        torch.cuda.synchronize()
    differ = float((images[0] - images[1]).abs().mean()) > 1e-3
    spread = min(float(image.std()) for image in images)
    return {"passed": differ and spread > 0.01, "device": device, "seconds": round(time.perf_counter() - start, 1),
            "size": SIZE, "steps": STEPS, "strengths_differ": differ, "min_stddev": round(spread, 4)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", type=Path, required=True)
    parser.add_argument("--assets", type=Path, required=True, help="the tiny FLUX.2's manifest, resolved (JSON)")
    parser.add_argument("--out", type=Path, required=True, help="the JSON result")
    args = parser.parse_args(argv)
    trainer = args.trainer.resolve()
    sys.path.insert(0, str(trainer))
    os.chdir(trainer)
    assets = json.loads(args.assets.read_text(encoding="utf-8"))
    try:
        result = check(trainer, assets, args.out.parent)
    except Exception as error:  # a sampling path that fails here is the finding
        result = {"passed": False, "error": f"{type(error).__name__}: {error}"[:800]}
    args.out.write_text(json.dumps(result) + "\n", encoding="utf-8")
    print(f"[selftest] sampling: {'pass' if result['passed'] else 'FAIL'} {json.dumps(result)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

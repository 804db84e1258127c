"""ComfyUI's own code on a trained LoRA and on the API workflow `comfy` wrote for it.

Run by tests/test_comfy.py under an interpreter with torch, with a ComfyUI source checkout
named by --comfyui (nothing of ComfyUI is copied here; it is imported from that checkout):

- `lora`: builds a FLUX.2 transformer the way ComfyUI does (`comfy.supported_models.Flux2` with
  the config `comfy.model_detection` reads from the base checkpoint, the tiny model's head count
  and rotary axes given), maps the LoRA with `comfy.lora.model_lora_keys_unet` +
  `comfy.lora.load_lora`, applies it with a `ModelPatcher` on the CPU, and compares every
  patched weight with base + B @ A.
- `api`: registers ComfyUI's nodes and runs `execution.validate_prompt`, what `POST /prompt` runs,
  with empty stand-in files for the models the workflow names.

Prints one JSON line; exits with MISSING_MODULE when ComfyUI needs a module this interpreter lacks.
"""

import argparse
import asyncio
import json
import logging
import sys
import tempfile
from pathlib import Path

MISSING_MODULE = 3


def import_comfy(checkout: str) -> None:
    sys.path.insert(0, checkout)
    import comfy.cli_args

    comfy.cli_args.args.cpu = True  # decided when comfy.model_management is first imported


def load_lora(base_path: str, lora_path: str, params: dict) -> dict:
    import comfy.lora
    import comfy.model_detection
    import comfy.model_patcher
    import comfy.supported_models
    import comfy.utils
    import torch

    base = comfy.utils.load_torch_file(base_path)
    unet_config = comfy.model_detection.detect_unet_config(base, "")
    unet_config.update({key: params[key] for key in ("num_heads", "axes_dim", "mlp_ratio", "theta")})
    model_config = comfy.supported_models.Flux2(unet_config)
    model_config.set_inference_dtype(torch.float32, None)  # so a small B @ A is not lost to bf16 rounding
    model = model_config.get_model(base, "", device=torch.device("cpu"))
    model.load_model_weights(dict(base), "")  # it pops what it loads
    lora = comfy.utils.load_torch_file(lora_path)
    skipped = []
    handler = logging.Handler()
    handler.emit = lambda record: skipped.append(record.getMessage())
    logging.getLogger().addHandler(handler)
    patches = comfy.lora.load_lora(lora, comfy.lora.model_lora_keys_unet(model, {}))
    logging.getLogger().removeHandler(handler)
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"),
                                               offload_device=torch.device("cpu"))
    patcher.add_patches(patches, 1.0)
    patcher.patch_model()
    patched = model.state_dict()
    errors, deltas = [], []
    for key in patches:
        module = key.removeprefix("diffusion_model.").removesuffix(".weight")
        down = lora[f"diffusion_model.{module}.lora_A.weight"].float()
        up = lora[f"diffusion_model.{module}.lora_B.weight"].float()
        original = base[key.removeprefix("diffusion_model.")].float()
        errors.append((patched[key].float() - (original + up @ down)).abs().max().item())
        deltas.append((patched[key].float() - original).abs().max().item())
    return {"tensors": len(lora), "patched": len(patches),
            "unmatched": [line for line in skipped if line.startswith("lora key not loaded")],
            "max_abs_error": max(errors, default=None), "max_delta": max(deltas, default=None)}


def validate_api(api_path: str, files: list[str]) -> dict:
    """ComfyUI's own prompt validation, with empty stand-ins for every file the workflow loads."""
    import execution
    import folder_paths
    import nodes

    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
    models = Path(tempfile.mkdtemp())
    for entry in files:
        folder, name = entry.split("/", 1)
        (models / folder).mkdir(exist_ok=True)
        (models / folder / name).write_bytes(b"")
        folder_paths.add_model_folder_path(folder, str(models / folder), is_default=True)
    prompt = json.loads(Path(api_path).read_text(encoding="utf-8"))
    valid, error, outputs, node_errors = asyncio.run(execution.validate_prompt("check", prompt, None))
    return {"valid": valid, "error": error, "outputs": outputs, "node_errors": node_errors}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("lora", "api"))
    parser.add_argument("--comfyui", required=True, help="a ComfyUI source checkout")
    parser.add_argument("--base", help="the transformer checkpoint the LoRA was trained on")
    parser.add_argument("--lora")
    parser.add_argument("--params", help="the tiny FLUX.2's parameters, JSON")
    parser.add_argument("--api", help="the API-format workflow")
    parser.add_argument("--file", action="append", default=[], help="FOLDER/NAME the workflow loads")
    args = parser.parse_args()
    try:
        import_comfy(args.comfyui)
        if args.mode == "lora":
            report = load_lora(args.base, args.lora, json.loads(args.params))
        else:
            report = validate_api(args.api, args.file)
    except ModuleNotFoundError as error:
        print(error)
        return MISSING_MODULE
    print(json.dumps(report, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

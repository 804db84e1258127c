"""Sample images of a FLUX.2 LoRA at several strengths, with the trainer's own model and pipeline.

The model loads the way training loads it (`Flux2Model.load_model`: the quantized cache, the
text phase for the prompts, which opens the streamed encoder only for prompts not cached yet).
The LoRA is applied as a forward hook on each Linear it names, y = base(x) + s * scale *
B(A(x)), so one loaded model gives every strength and the 4-bit base weights are never
touched: the trainer's own `merge_in` rewrites the base weight, which a torchao 4-bit weight
refuses (UintxTensor has no clone) and which ties every image of a call to one strength.

Wall 6, black previews: an image is black when the decoded tensor holds NaN or inf (they turn
into 0 when cast to 8 bits). The denoising loop here keeps the latents in float32 (the
trainer's pipeline adds each Euler step to bf16 latents) and decodes with the VAE in float32;
every step's prediction and the decoded image are checked, and a non-finite value stops the
sample with the step or stage that made it, instead of writing a black picture.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Sequence

import torch

LORA_PREFIX = "diffusion_model."
SHEET_GAP = 4  # pixels between the contact sheet's cells
GUIDANCE = 4.0  # the FLUX.2 [dev] template's guidance


class NonFiniteSample(RuntimeError):
    """A sample produced NaN or inf; the message says where."""


@dataclass
class LoraHooks:
    """A LoRA applied to a model's Linears by forward hooks; `strength` is read at every call."""

    strength: float = 1.0
    handles: list = field(default_factory=list)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def lora_modules(state_dict: Dict[str, torch.Tensor]) -> Dict[str, dict]:
    """{module path: {down, up, scale}} from `diffusion_model.<m>.lora_A/lora_B.weight` (+ alpha)."""
    modules: Dict[str, dict] = {}
    for key, tensor in state_dict.items():
        if not key.startswith(LORA_PREFIX):
            raise ValueError(f"LoRA tensor {key!r} does not start with {LORA_PREFIX!r}")
        module, _, part = key[len(LORA_PREFIX):].rpartition(".lora_")
        if part in ("A.weight", "B.weight"):
            modules.setdefault(module, {})["down" if part == "A.weight" else "up"] = tensor
        elif key.endswith(".alpha"):
            modules.setdefault(key[len(LORA_PREFIX):-len(".alpha")], {})["alpha"] = float(tensor)
    for module, parts in modules.items():
        rank = parts["down"].shape[0]
        parts["scale"] = parts.get("alpha", rank) / rank
    return modules


def attach_lora(transformer: torch.nn.Module, state_dict: Dict[str, torch.Tensor], device, dtype) -> LoraHooks:
    """Hook every Linear the LoRA names; a module the transformer lacks is an error."""
    hooks = LoraHooks()
    named = dict(transformer.named_modules())
    for path, parts in lora_modules(state_dict).items():
        if path not in named:
            raise ValueError(f"the LoRA names {path!r}, which this transformer does not have")
        down = parts["down"].to(device, dtype)
        up = parts["up"].to(device, dtype)
        scale = parts["scale"]

        def add_lora(module, inputs, output, down=down, up=up, scale=scale):
            if hooks.strength == 0:
                return output
            delta = torch.nn.functional.linear(torch.nn.functional.linear(inputs[0].to(dtype), down), up)
            return output + (hooks.strength * scale) * delta.to(output.dtype)

        hooks.handles.append(named[path].register_forward_hook(add_lora))
    return hooks


def require_finite(tensor: torch.Tensor, where: str) -> None:
    if not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise NonFiniteSample(f"{where}: {bad} of {tensor.numel()} values are NaN or inf "
                              "(this is what made 4-bit previews black)")


@torch.no_grad()
def denoise(model, embeds: torch.Tensor, size: int, steps: int, seed: int) -> torch.Tensor:
    """One image, [3, size, size] in [0, 1] on the CPU, from the model's transformer and VAE."""
    from extensions_built_in.diffusion_models.flux2.src.sampling import (
        batched_prc_img, batched_prc_txt, get_schedule, scatter_ids,
    )

    device, dtype = model.device_torch, model.torch_dtype
    transformer, pipeline = model.transformer, model.pipeline
    channels, factor = pipeline.num_channels_latents, pipeline.vae_scale_factor
    generator = torch.Generator("cpu").manual_seed(seed)  # the same noise on every device
    noise = torch.randn((1, channels, size // factor, size // factor), generator=generator, dtype=torch.float32)
    latents, img_ids = batched_prc_img(noise.to(device))
    txt, txt_ids = batched_prc_txt(embeds.to(device, dtype))
    guidance = torch.full((1,), GUIDANCE, device=device, dtype=dtype)
    timesteps = get_schedule(steps, latents.shape[1])
    for index, (t_curr, t_prev) in enumerate(zip(timesteps[:-1], timesteps[1:])):
        pred = transformer(x=latents.to(dtype), x_ids=img_ids, timesteps=torch.full((1,), t_curr, device=device, dtype=dtype),
                           ctx=txt, ctx_ids=txt_ids, guidance=guidance)
        require_finite(pred, f"the transformer's prediction at step {index + 1} of {steps} (t={t_curr:.3f})")
        latents = latents + (t_prev - t_curr) * pred.float()
    latents = torch.cat(scatter_ids(latents, img_ids)).squeeze(2)
    vae = model.vae
    vae_dtype, vae_device = next(vae.parameters()).dtype, next(vae.parameters()).device
    vae.to(device, torch.float32)
    try:
        image = vae.decode(latents.to(device, torch.float32)).float()
    finally:
        vae.to(vae_device, vae_dtype)
    require_finite(image, "the VAE decode")
    return ((image[0] + 1) / 2).clamp(0, 1).cpu()


def to_pil(image: torch.Tensor):
    from PIL import Image

    array = (image.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
    return Image.fromarray(array)


def contact_sheet(cells: List[List[torch.Tensor]]):
    """One PIL image: rows = prompts, columns = strengths, SHEET_GAP white pixels between cells."""
    from PIL import Image

    size = cells[0][0].shape[-1]
    rows, columns = len(cells), len(cells[0])
    sheet = Image.new("RGB", (columns * size + (columns - 1) * SHEET_GAP, rows * size + (rows - 1) * SHEET_GAP), "white")
    for row, images in enumerate(cells):
        for column, image in enumerate(images):
            sheet.paste(to_pil(image), (column * (size + SHEET_GAP), row * (size + SHEET_GAP)))
    return sheet


@dataclass
class SampleRequest:
    prompts: List[str]
    strengths: List[float]
    seed: int
    size: int
    steps: int
    out_dir: Path


def sample_grid(model, hooks, request: SampleRequest, log=print) -> List[Path]:
    """Every prompt at every strength, same seed; PNGs and `contact_sheet.png` in out_dir.

    `hooks` has a settable `strength` (LoraHooks, NetworkStrength) or is None (base model only)."""
    request.out_dir.mkdir(parents=True, exist_ok=True)
    embeds = model.text_embeddings.get(request.prompts) if getattr(model, "text_embeddings", None) is not None \
        else torch.cat([model.get_prompt_embeds(p).text_embeds.cpu() for p in request.prompts])
    written, cells = [], []
    start = hooks.strength if hooks is not None else 1.0
    try:
        for row, prompt in enumerate(request.prompts):
            cells.append([])
            for strength in request.strengths:
                if hooks is not None:
                    hooks.strength = strength
                image = denoise(model, embeds[row : row + 1], request.size, request.steps, request.seed)
                path = request.out_dir / f"p{row}_s{strength:g}.png"
                to_pil(image).save(path)
                written.append(path)
                cells[-1].append(image)
                log(f"[sample] {path.name}: prompt {row + 1}, strength {strength:g}")
    finally:
        if hooks is not None:
            hooks.strength = start
    sheet = request.out_dir / "contact_sheet.png"
    contact_sheet(cells).save(sheet)
    written.append(sheet)
    return written


IN_TRAINING_STRENGTHS = [0.0, 1.0]  # the base model beside the LoRA as trained so far


def sample_in_training(process, step: int) -> Path:
    """The train loop's samples at `step`, with the model already on the device.

    Prompts, seed, size and steps come from the process's `sample:` block; the columns are
    strengths 0 and 1 of the LoRA being trained (the trainer's own network, its multiplier set
    per column, so nothing is copied). Telemetry gets a "sample_start" and a "sample" row, each
    with VRAM and host RSS, to show that nothing stays resident; the training RNG is untouched
    (the noise has its own generator) and the network and transformer modes are restored.
    """
    from toolkit import trainer_telemetry
    from toolkit.accelerator import unwrap_model
    from toolkit.basic import flush
    from toolkit.config_modules import GenerateImageConfig

    config, model = process.sample_config, process.sd
    prompts = [model.inject_trigger_into_prompt(GenerateImageConfig(prompt=p, output_path="unused.jpg").prompt,
                                                process.trigger_word, add_if_not_present=False)
               if process.trigger_word else GenerateImageConfig(prompt=p, output_path="unused.jpg").prompt
               for p in config.prompts]
    request = SampleRequest(prompts, IN_TRAINING_STRENGTHS, int(config.seed or 0), int(config.width),
                            int(config.sample_steps), Path(process.training_folder) / "samples" / str(step))
    network = unwrap_model(process.network) if process.network is not None else None
    transformer = model.transformer
    was_training, start = transformer.training, time.perf_counter()
    trainer_telemetry.record_event("sample_start", step)
    transformer.eval()
    try:
        if network is None:
            written = sample_grid(model, None, request)
        else:
            multiplier = network.multiplier
            network.eval()
            try:
                with network:
                    written = sample_grid(model, NetworkStrength(network), request)
            finally:
                network.multiplier = multiplier
                network.train()
    finally:
        transformer.train(was_training)
        flush()
    trainer_telemetry.record_event("sample", step, seconds=round(time.perf_counter() - start, 3),
                                   images=len(written) - 1)
    return written[-1]


class NetworkStrength:
    """The trainer's own LoRA network seen as LoraHooks: `strength` is its multiplier."""

    def __init__(self, network):
        self.network = network

    @property
    def strength(self) -> float:
        return self.network.multiplier

    @strength.setter
    def strength(self, value: float) -> None:
        self.network.multiplier = value


def load_model(model_config: dict, dtype: str, prompts: Sequence[str], training_folder: str, device=None):
    """The run's model, loaded as training loads it, with `prompts` planned for the text phase."""
    from toolkit.config_modules import ModelConfig
    from toolkit.text_phase import RunPrompts
    from toolkit.util.get_model import get_model_class

    config = ModelConfig(**model_config)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = get_model_class(config)(device=device, model_config=config, dtype=dtype)
    model.training_folder = training_folder
    model.plan_prompts = lambda: RunPrompts(list(dict.fromkeys(prompts)))
    model.load_model()
    model.transformer.to(model.device_torch)
    model.transformer.eval()
    return model


def load_lora(path: Path) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path), device="cpu")

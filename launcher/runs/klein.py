"""FLUX.2 klein (4B and 9B): the trainer target that has it, its files and its transformer's shape.

ai-toolkit trains klein as `Flux2Klein4BModel` / `Flux2Klein9BModel` (arch `flux2_klein_4b` /
`flux2_klein_9b`, extensions_built_in/diffusion_models/flux2/flux2_klein_model.py in
https://github.com/ostris/ai-toolkit), subclasses of the Flux2Model the series patches, with a
Qwen3 text encoder instead of Mistral. The pinned AMD fork predates them, so a klein preset is
refused on a checkout without them, in one line naming the target that has them, before anything
loads. The shapes are the trainer's Klein4BParams / Klein9BParams (src/model.py there): a klein
preset writes them as `model_kwargs.flux2_params`, so the launcher's memory plan, `qtype: auto`
and the checks of the model folder see the klein transformer, not FLUX.2 [dev]'s.
"""

import re
from dataclasses import dataclass
from pathlib import Path

from launcher.runs.schema_nodes import Vocabulary, short


@dataclass(frozen=True)
class KleinModel:
    label: str
    target: str
    """The upstream.lock target whose trainer has this model class."""
    transformer_file: str
    """What the trainer looks for in the model folder (its `flux2_te_filename`)."""
    text_encoder: str
    """The hub id the trainer loads the Qwen3 encoder from."""
    shape: dict


KLEIN = {
    "flux2_klein_4b": KleinModel(
        "FLUX.2 klein 4B", "upstream-main", "flux-2-klein-base-4b.safetensors", "Qwen/Qwen3-4B",
        {"in_channels": 128, "context_in_dim": 7680, "hidden_size": 3072, "num_heads": 24, "depth": 5,
         "depth_single_blocks": 20, "axes_dim": [32, 32, 32, 32], "theta": 2000, "mlp_ratio": 3.0}),
    "flux2_klein_9b": KleinModel(
        "FLUX.2 klein 9B", "upstream-main", "flux-2-klein-base-9b.safetensors", "Qwen/Qwen3-8B",
        {"in_channels": 128, "context_in_dim": 12288, "hidden_size": 4096, "num_heads": 32, "depth": 8,
         "depth_single_blocks": 24, "axes_dim": [32, 32, 32, 32], "theta": 2000, "mlp_ratio": 3.0}),
}
MODEL_CLASS_ARCH = re.compile(r"^\s+arch\s*=\s*['\"]([\w.\-]+)['\"]", re.M)


def trainer_arches(trainer: Path) -> set[str] | None:
    """The `arch` of every model class of the trainer's extensions (None: no extensions folder)."""
    folder = trainer / "extensions_built_in"
    if not folder.is_dir():
        return None
    found: set[str] = set()
    for path in sorted(folder.rglob("*.py")):
        found |= set(MODEL_CLASS_ARCH.findall(path.read_text(encoding="utf-8", errors="replace")))
    return found


def needed_target(arch) -> str | None:
    """The target a preset of `arch` needs, where only some targets have it."""
    model = KLEIN.get(arch) if isinstance(arch, str) else None
    return model.target if model else None


def arch_problems(data: dict, vocab: Vocabulary) -> list[str]:
    """A klein arch on a trainer checkout without it: the target that has it, and the setup line."""
    if vocab.arches is None:
        return []
    problems = []
    for index, process in enumerate(_processes(data)):
        arch = process["model"].get("arch")
        model = KLEIN.get(arch) if isinstance(arch, str) else None
        if model is not None and arch not in vocab.arches:
            problems.append(
                f"config.process[{index}].model.arch = {short(arch)}: {model.label} needs the trainer target "
                f"{model.target}, and this workdir's checkout has no {arch} (the default target amd-fork predates "
                f"it); run `python -m launcher setup --target {model.target} --workdir W` and train with --workdir W")
    return problems


def _processes(data: dict) -> list[dict]:
    config = data.get("config")
    process = config.get("process") if isinstance(config, dict) else None
    return [item for item in process if isinstance(item, dict) and isinstance(item.get("model"), dict)] \
        if isinstance(process, list) else []

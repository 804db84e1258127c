"""Will ComfyUI load this LoRA? Its tensor names and shapes against the FLUX.2 transformer it was trained on.

ComfyUI's loader (`comfy.lora`) patches a FLUX.2 weight only for tensors named
`diffusion_model.<module>.lora_A.weight` / `.lora_B.weight` (optionally `.alpha`) where
`<module>.weight` is a weight of the model. Any other tensor is skipped with a log line nobody
reads: a LyCORIS network (LoKr, LoHa, ...) from the same trainer loads nothing, and the images
look exactly like the base model's. Only safetensors headers are read (names and shapes), so
the check takes a moment even against the 64 GB base checkpoint.

The rule is ComfyUI's generic LoRA key map, `model_lora_keys_unet` in comfy/lora.py
(https://github.com/comfyanonymous/ComfyUI/blob/master/comfy/lora.py): every
`diffusion_model.<module>.weight` of the loaded model's state dict is patched by the LoRA tensors
named `diffusion_model.<module>` + `.lora_A.weight` / `.lora_B.weight` / `.alpha` (comfy/weight_adapter/lora.py).
It holds for any model whose ComfyUI state dict keeps the checkpoint's own names, as FLUX.2 does;
FLUX.2 klein (4B, 9B) is the same Flux2 module tree, so its LoRA is checked the same way, against
its own checkpoint (`flux-2-klein-base-4b.safetensors` / `-9b`): a module of FLUX.2 [dev] that
klein lacks, or another width, is named.
"""

import re
from dataclasses import dataclass
from pathlib import Path

from flux2_contract.families import family_of
from launcher.errors import LauncherError
from launcher.runs.validate import safetensors_header

LORA_KEY = re.compile(r"^diffusion_model\.(?P<module>.+)\.(?P<part>lora_A\.weight|lora_B\.weight|alpha)$")
BASE_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
FOREIGN_NETWORKS = {
    # what the tensor names of another kind of network look like -> that kind
    re.compile(r"\.lokr_w"): "LoKr",
    re.compile(r"\.hada_w"): "LoHa",
    re.compile(r"\.b?oft_"): "OFT",
    re.compile(r"\.lora_(down|up)\."): "kohya-style LoRA/LoCon",
    re.compile(r"^lycoris_"): "LyCORIS",
}
FIX = "train with `network: {type: lora}` in the preset (rank and alpha from `linear` / `linear_alpha`)"
SHOWN = 5


@dataclass(frozen=True)
class LoraSummary:
    modules: int
    tensors: int
    ranks: tuple[int, ...]


def base_checkpoint(name_or_path: str, arch: str | None = None) -> Path:
    """The transformer checkpoint a run's config names: the file itself, or in the folder the file the
    trainer loads for the run's `arch` (its family's transformer file)."""
    path = Path(name_or_path)
    return path if path.suffix == ".safetensors" else path / family_of(arch).transformer_file


def check_lora(lora: Path, base: Path) -> LoraSummary:
    """Every tensor of `lora` is a ComfyUI FLUX.2 LoRA tensor of a Linear of `base`, shapes matching."""
    header = safetensors_header(lora)
    shapes = {key: entry["shape"] for key, entry in header.items() if key != "__metadata__"}
    _refuse_foreign_network(lora, shapes)
    unmatched = [key for key in shapes if not LORA_KEY.match(key)]
    if unmatched:
        raise LauncherError(
            f"{lora} is not a LoRA ComfyUI can load: {len(unmatched)} of {len(shapes)} tensors are not named "
            f"diffusion_model.<module>.lora_A/lora_B.weight, e.g. {', '.join(unmatched[:SHOWN])}; "
            f"if it came from this trainer, {FIX}"
        )
    if not base.is_file():
        raise LauncherError(
            f"the run's base checkpoint {base} is missing; the LoRA's shapes are checked against its header: "
            "put the file back where the run's config.yaml names it"
        )
    linears = _linear_shapes(safetensors_header(base))
    modules: dict[str, dict[str, list[int]]] = {}
    for key, shape in shapes.items():
        match = LORA_KEY.match(key)
        modules.setdefault(match["module"], {})[match["part"]] = shape
    problems = [problem for module, parts in modules.items() for problem in _shape_problems(module, parts, linears)]
    if problems:
        raise LauncherError(
            f"{lora} does not fit the FLUX.2 transformer {base} in {len(problems)} of {len(modules)} modules, e.g.:\n  "
            + "\n  ".join(problems[:SHOWN]) + "\nwas it trained on another model? train it again on this base"
        )
    ranks = sorted({parts["lora_A.weight"][0] for parts in modules.values()})
    return LoraSummary(modules=len(modules), tensors=len(shapes), ranks=tuple(ranks))


def _refuse_foreign_network(lora: Path, shapes: dict[str, list[int]]) -> None:
    for pattern, kind in FOREIGN_NETWORKS.items():
        keys = [key for key in shapes if pattern.search(key)]
        if keys:
            raise LauncherError(
                f"{lora} is a {kind} network ({len(keys)} of {len(shapes)} tensors like {keys[0]}): ComfyUI's "
                f"FLUX.2 loader matches none of them and would silently load nothing; {FIX}"
            )


def _linear_shapes(header: dict) -> dict[str, list[int]]:
    """{module path: [out, in]} for every 2-D `.weight` of the transformer (its Linears)."""
    found = {}
    for key, entry in header.items():
        if key == "__metadata__" or not key.endswith(".weight") or len(entry["shape"]) != 2:
            continue
        module = key[: -len(".weight")]
        for prefix in BASE_PREFIXES:
            module = module.removeprefix(prefix)
        found[module] = entry["shape"]
    return found


def _shape_problems(module: str, parts: dict[str, list[int]], linears: dict[str, list[int]]) -> list[str]:
    if module not in linears:
        return [f"{module}: not a Linear of the transformer"]
    down, up = parts.get("lora_A.weight"), parts.get("lora_B.weight")
    if down is None or up is None:
        return [f"{module}: lora_A and lora_B must both be present"]
    out_features, in_features = linears[module]
    if len(down) != 2 or len(up) != 2 or down[1] != in_features or up[0] != out_features or down[0] != up[1]:
        return [(f"{module}: lora_A {down} and lora_B {up} do not fit the Linear's weight {[out_features, in_features]} "
                 f"(expected lora_A [r, {in_features}], lora_B [{out_features}, r])")]
    return []

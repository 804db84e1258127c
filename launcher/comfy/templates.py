"""Which ComfyUI template a run's LoRA goes into, and how the template's model file relates to the run's.

ComfyUI ships a text-to-image template per FLUX.2 family (package `comfyui-workflow-templates-json`):
[dev] `image_flux2_text_to_image`; klein 4B `image_flux2_klein_text_to_image`, with two subgraphs,
klein base 4B (CFG, 20 steps) and the 4-step distilled klein 4B; klein 9B
`image_flux2_text_to_image_9b`, klein base 9B only (each family's `comfy` in flux2_contract/families.py).
The trainer trains klein on its base model, so a klein LoRA goes into the base subgraph and the
distilled one is left out. The templates' model loaders name ComfyUI's files, which are not always
the file the run trained on (klein 9B's is an fp8 build): `base_model_note` says which file goes where.
"""

from pathlib import Path

from flux2_contract.families import ComfyTemplate, family_of
from launcher.comfy import folder

MODEL_DIRECTORY = "diffusion_models"


def template_for(arch) -> ComfyTemplate:
    """The template of a run's `model.arch`: its family's."""
    return family_of(arch).comfy


def base_model_note(template: ComfyTemplate, models: list[dict], base: Path, comfy_dir: Path | None) -> str | None:
    """Where the family asks for it (klein): whether the template's transformer file is the run's base
    checkpoint, and what to put into models/diffusion_models/ (None for [dev], whose report is as it
    always was)."""
    if not template.base_model_note:
        return None
    model = next((m for m in models if m["directory"] == MODEL_DIRECTORY), None)
    if model is None:
        return None
    if model["name"] == base.name:
        return (f"the workflow's model loader names {model['name']}, the file name of this run's base checkpoint "
                f"{base} (the one the LoRA was checked against): copy or link that file into "
                f"models/{MODEL_DIRECTORY}/, or download {folder.model_location(model)}")
    precision = " (an fp8 build of the model)" if "fp8" in model["name"] else ""
    found = folder.find_model(comfy_dir, {"directory": MODEL_DIRECTORY, "name": base.name}) if comfy_dir else None
    choice = (f"{found} is there: choose it" if found else
              f"or put {base} into models/{MODEL_DIRECTORY}/ and choose {base.name}")
    return (f"the workflow's model loader names the template's {model['name']}{precision}, not {base.name}, the "
            f"checkpoint this run trained on (the LoRA was checked against {base}): download "
            f"{folder.model_location(model)}; {choice} in the Load Diffusion Model node for the weights "
            "the LoRA was trained on")

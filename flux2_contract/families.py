"""The model families the launcher trains: every fact that differs between them, one record each.

A preset names its family by the trainer's `model.arch` (`flux2`, `flux2_klein_4b`, ...); every
part of the launcher that depends on the model asks `family_of(arch)` instead of testing the arch
itself, so a family is added as one `Family` below (and, for a tiny preset, a builder in
launcher/in_trainer/tiny_assets.py). An arch the registry does not know is FLUX.2 [dev], as the
trainer's own default is.

ai-toolkit trains FLUX.2 [dev] as `Flux2Model` and FLUX.2 klein as `Flux2Klein4BModel` /
`Flux2Klein9BModel` (extensions_built_in/diffusion_models/flux2/ in
https://github.com/ostris/ai-toolkit), subclasses of the Flux2Model the series patches with a Qwen3
text encoder instead of Mistral. The pinned AMD fork predates klein, so a klein preset is refused
on a checkout without it (launcher/runs/schema.py). klein's shapes are the trainer's Klein4BParams /
Klein9BParams (src/model.py there); the launcher writes them as `model_kwargs.flux2_params` where a
preset gives none, so the memory plan, `qtype: auto` and the checks of the model folder see the
klein transformer, not FLUX.2 [dev]'s.

Standard library only: the launcher imports it, and so does code run under the trainer's
interpreter (launcher/in_trainer/, tests/test_layout.py).
"""

from dataclasses import dataclass

DEFAULT_ARCH = "flux2"
"""The arch of a model block that names none (the trainer's default)."""


@dataclass(frozen=True)
class TextEncoder:
    kind: str
    """The encoder's model class, as messages name it."""
    hub_id: str
    """Where the trainer loads it from when no folder is given."""
    processor: bool
    """Whether its folder needs a processor (Mistral3), else a tokenizer is enough."""
    model_type: str | None
    """The `model_type` its config.json must name; None: not checked."""


@dataclass(frozen=True)
class ComfyTemplate:
    name: str
    """The text-to-image template's file name in ComfyUI's template package, without .json."""
    subgraph: str | None
    """The subgraph kept (the model the LoRA was trained on); None: the template as it is."""
    base_model_note: bool
    """Whether `comfy` says how the template's model file relates to the run's base checkpoint."""


@dataclass(frozen=True)
class TinyRecipe:
    folder: str
    """Its folder under the workdir's assets."""
    builder: str
    """The builder of launcher/in_trainer/tiny_assets.py (its BUILDERS) that makes it."""
    label: str
    """What the progress line and errors call it."""


@dataclass(frozen=True)
class Family:
    arch: str
    """The trainer's `model.arch` of this family."""
    label: str
    """The model's name in messages (its repository's name for FLUX.2 [dev])."""
    about: str
    """One paragraph for its doc page (docs/families/)."""
    transformer_file: str
    """What the trainer looks for in the model folder (its `flux2_te_filename`)."""
    text_encoder: TextEncoder
    shape: dict
    """The transformer's Flux2Params (model_kwargs.flux2_params)."""
    target: str | None
    """The upstream.lock target whose trainer has this model class; None: every target."""
    comfy: ComfyTemplate
    tiny: TinyRecipe | None
    """The embedded tiny model of this family's tiny presets; None: it has none."""

    @property
    def page(self) -> str:
        """Its doc page's name under docs/families/."""
        return self.arch.replace("_", "-") + ".md"


MISTRAL3 = TextEncoder("Mistral3", "mistralai/Mistral-Small-3.1-24B-Instruct-2503", processor=True, model_type=None)

FLUX2_DEV = Family(
    arch=DEFAULT_ARCH, label="FLUX.2-dev",
    about="FLUX.2 [dev], the 32B rectified-flow transformer (8 double and 48 single blocks, hidden 6144) "
          "with the Mistral-Small-3.1-24B text encoder: the model every preset but the klein ones trains.",
    transformer_file="flux2-dev.safetensors", text_encoder=MISTRAL3,
    shape={"in_channels": 128, "context_in_dim": 15360, "hidden_size": 6144, "num_heads": 48, "depth": 8,
           "depth_single_blocks": 48, "axes_dim": [32, 32, 32, 32], "theta": 2000, "mlp_ratio": 3.0},
    target=None,
    comfy=ComfyTemplate("image_flux2_text_to_image", None, base_model_note=False),
    tiny=TinyRecipe("tiny", "flux2", "the tiny FLUX.2"))

KLEIN_4B = Family(
    arch="flux2_klein_4b", label="FLUX.2 klein 4B",
    about="FLUX.2 klein 4B, the small FLUX.2 transformer (5 double and 20 single blocks, hidden 3072, no "
          "guidance embedding) with a Qwen3-4B text encoder, trained on its base (undistilled) model.",
    transformer_file="flux-2-klein-base-4b.safetensors",
    text_encoder=TextEncoder("Qwen3", "Qwen/Qwen3-4B", processor=False, model_type="qwen3"),
    shape={"in_channels": 128, "context_in_dim": 7680, "hidden_size": 3072, "num_heads": 24, "depth": 5,
           "depth_single_blocks": 20, "axes_dim": [32, 32, 32, 32], "theta": 2000, "mlp_ratio": 3.0},
    target="upstream-main",
    comfy=ComfyTemplate("image_flux2_klein_text_to_image", "Text to Image (FLUX.2 Klein 4B)", base_model_note=True),
    tiny=TinyRecipe("tiny_klein", "klein_4b", "the tiny FLUX.2 klein 4B"))

KLEIN_9B = Family(
    arch="flux2_klein_9b", label="FLUX.2 klein 9B",
    about="FLUX.2 klein 9B, the larger klein transformer (8 double and 24 single blocks, hidden 4096, no "
          "guidance embedding) with a Qwen3-8B text encoder, trained on its base (undistilled) model.",
    transformer_file="flux-2-klein-base-9b.safetensors",
    text_encoder=TextEncoder("Qwen3", "Qwen/Qwen3-8B", processor=False, model_type="qwen3"),
    shape={"in_channels": 128, "context_in_dim": 12288, "hidden_size": 4096, "num_heads": 32, "depth": 8,
           "depth_single_blocks": 24, "axes_dim": [32, 32, 32, 32], "theta": 2000, "mlp_ratio": 3.0},
    target="upstream-main",
    comfy=ComfyTemplate("image_flux2_text_to_image_9b", "Text to Image (FLUX.2 Klein 9B)", base_model_note=True),
    tiny=None)

FAMILIES = {family.arch: family for family in (FLUX2_DEV, KLEIN_4B, KLEIN_9B)}


def family_of(arch) -> Family:
    """The family of a model block's `arch`; FLUX.2 [dev] for one the registry does not know (or none)."""
    return FAMILIES.get(arch, FLUX2_DEV) if isinstance(arch, str) else FLUX2_DEV

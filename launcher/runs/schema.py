"""One schema for a preset: the `launcher:` block and the trainer keys the presets use.

Each key has a type, a range or a set of allowed values; blocks nest (`model_kwargs`,
`launcher.watchdog`). A preset is checked before anything heavy starts and every problem is
reported at once, each naming the key path, the value, what is allowed and, for an unknown key or
value, the closest known one (launcher/runs/schema_nodes.py). Scalars are stated in the settings
catalogue's kinds (`flag`, `whole`, `number`, `Text`) and checked by its rule, in its words. Values the trainer decides (qtypes,
optimizers, network types, dtypes, the keys each section reads) come from a `Vocabulary` read
from the trainer itself (launcher/runs/vocabulary.py); without a trainer checkout those parts are
not checked. `launcher.env` is launcher/runs/trainer_env.py, `flux2_params` launcher/runs/flux2_shape.py
and `launcher.watchdog` launcher/runs/watchdog_schema.py.
"""

from flux2_contract import qtypes, settings
from flux2_contract.families import family_of
from launcher.runs import launcher_settings
from launcher.runs.flux2_shape import FLUX2_PARAMS, flux2_params_problems
from launcher.runs.schema_nodes import (Anything, Block, Extension, ListOf, Nullable, OneOrList, PlainName, Text,
                                        Vocabulary, catalogued, flag, kind_of, number, short, whole)
from launcher.runs.trainer_env import env_block
from launcher.runs.watchdog_schema import watchdog_block

MAX_STEPS = 10_000_000
"""Steps, save and sample cadences: a month of training at a step every quarter second."""
MAX_RANK = 1024
"""LoRA rank: far above the 16-128 LoRAs train at; at 1024 one LoRA of FLUX.2 [dev] is already about
12 GB (disk_budget.LORA_PARAMS_PER_RANK, bf16)."""
RESOLUTION = whole(16, 4096, multiple_of=16)
QTYPE = Text(lambda v: v.qtypes)
AUTO = "auto"
"""The launcher's own qtype: `run` turns it into a qtype from the self-test (launcher/selftest/verdict.py)
before the trainer reads the config, so only the transformer's qtype may say it."""
MODEL_QTYPE = Text(lambda v: v.qtypes | {AUTO} if v.qtypes is not None else None)
DTYPE = Text(lambda v: v.dtypes)


def launcher_block() -> Block:
    return Block(catalogued(launcher_settings.SETTINGS, {
        "env": env_block(),
        # faster only grows the files; an hour apart the telemetry says nothing
        "telemetry": Block({"interval_s": number(0.1, 3600)}),
        "watchdog": watchdog_block(),
        "card": Text(max_chars=200),
    }))


MAX_PROMPT_CHARS = 128 * 1024
"""A sample prompt: the text encoder reads at most a few hundred tokens of it."""
MAX_TRIGGER_CHARS = 200

MODEL_KWARGS = Block(catalogued(settings.model_kwargs_settings(),
                                {"flux2_params": FLUX2_PARAMS, "ae_params": Block(extra=Anything())}),
                     extra="model_kwargs")
"""The project's model_kwargs (flux2_contract/settings.py) plus the trainer's own keys (the vocabulary)."""

PROCESS = Block({
    "type": Text(),
    "training_seed": whole(0, 2**32 - 1),
    "training_folder": Text(),
    "trigger_word": Nullable(Text(max_chars=MAX_TRIGGER_CHARS)),
    "network": Block({
        "type": Text(lambda v: v.network_types, fold_case=True),
        "linear": whole(1, MAX_RANK), "linear_alpha": number(maximum=65536, above=0),
        "conv": whole(1, MAX_RANK), "conv_alpha": number(maximum=65536, above=0),
    }, extra="network"),
    "save": Block({"dtype": DTYPE, "save_every": whole(1, MAX_STEPS),
                   "max_step_saves_to_keep": whole(1, 1000)}, extra="save"),
    "datasets": ListOf(Block({
        "folder_path": Text(), "caption_ext": Extension(), "cache_latents_to_disk": flag(),
        "caption_dropout_rate": number(0, 1), "resolution": OneOrList(RESOLUTION),
        "bucket_tolerance": whole(1, 1024),
    }, extra="datasets"), min_items=1),
    "train": Block({
        "batch_size": whole(1, 1024), "steps": whole(1, MAX_STEPS),
        "gradient_accumulation": whole(1, 1024),
        "gradient_accumulation_steps": whole(1, 1024),
        "lr": number(maximum=10, above=0), "dtype": DTYPE,
        "optimizer": Text(lambda v: v.optimizers, lambda v: v.optimizer_prefixes, fold_case=True),
        **{key: flag() for key in ("train_unet", "train_text_encoder", "gradient_checkpointing",
                                        "cache_text_embeddings", "disable_sampling")},
    }, extra="train"),
    "model": Block({
        "name_or_path": Text(), "arch": Text(), "qtype": MODEL_QTYPE, "qtype_te": QTYPE,
        **{key: flag() for key in ("quantize", "quantize_te", "low_vram", "layer_offloading")},
        "model_kwargs": MODEL_KWARGS,
    }, extra="model"),
    "sample": Block({"sample_every": whole(1, MAX_STEPS), "sample_steps": whole(1, 1000),
                     "width": RESOLUTION, "height": RESOLUTION,
                     "prompts": ListOf(Text(max_chars=MAX_PROMPT_CHARS))}, extra="sample"),
    "logging": Block(extra="logging"),
}, extra="process", required=("datasets", "train", "model"))


def preset_schema() -> Block:
    return Block({
        "job": Text(lambda v: v.jobs),
        "config": Block({"name": PlainName(), "process": ListOf(PROCESS, min_items=1)},
                        extra=Anything(), required=("name", "process")),
        "meta": Block(extra=Anything()),
        "launcher": launcher_block(),
    }, required=("job", "config"))


def check_preset(data, vocab: Vocabulary = Vocabulary()) -> list[str]:
    """Every problem of a parsed preset, as messages; empty when it is fine."""
    if not isinstance(data, dict):
        return [f"the preset is {kind_of(data)}, not a mapping; it needs `job:`, `config:` and optionally `launcher:`"]
    return [*preset_schema().check(data, "", vocab), *quantized_network_problems(data, vocab),
            *flux2_params_problems(data), *arch_problems(data, vocab)]


def arch_problems(data: dict, vocab: Vocabulary) -> list[str]:
    """A family's arch on a trainer checkout without it: the target that has it, and the setup line."""
    if vocab.arches is None:
        return []
    config = data.get("config")
    process = config.get("process") if isinstance(config, dict) else None
    problems = []
    for index, item in enumerate(process if isinstance(process, list) else []):
        arch = item["model"].get("arch") if isinstance(item, dict) and isinstance(item.get("model"), dict) else None
        family = family_of(arch)
        if family.target is not None and arch not in vocab.arches:
            problems.append(
                f"config.process[{index}].model.arch = {short(arch)}: {family.label} needs the trainer target "
                f"{family.target}, and this workdir's checkout has no {arch} (the default target amd-fork predates "
                f"it); run `python -m launcher setup --target {family.target} --workdir W` and train with --workdir W")
    return problems


LOW_RANK_TYPES = {"lora", "locon"}
"""Networks that add their own up/down Linears beside a frozen base weight: these train on a
4-bit base. LoKr, LoHa and the like build a delta and add it to the base weight, which the
4-bit tensor subclasses do not implement (torchao: NotImplementedError for aten.add at step 1)."""


def quantized_network_problems(data: dict, vocab: Vocabulary) -> list[str]:
    """A network type the 4-bit base cannot train, found before the model loads."""
    process = (data.get("config") or {}).get("process") if isinstance(data.get("config"), dict) else None
    problems = []
    for index, item in enumerate(process if isinstance(process, list) else []):
        if not isinstance(item, dict) or not isinstance(item.get("network"), dict) \
                or not isinstance(item.get("model"), dict):
            continue
        kind, model = item["network"].get("type", "lora"), item["model"]
        qtype = str(model.get("qtype", ""))
        unknown = vocab.network_types is not None and str(kind).lower() not in vocab.network_types  # said above
        if isinstance(kind, str) and not unknown and kind.lower() not in LOW_RANK_TYPES and model.get("quantize") is True \
                and (qtype in (qtypes.FALLBACK, *qtypes.QTYPES) or qtype == AUTO):
            problems.append(
                f"config.process[{index}].network.type = {short(kind)}: the 4-bit base (model.qtype {qtype}) cannot "
                f"train it (it adds its delta to the quantized weight, which fails at step 1); allowed there: "
                f"{' | '.join(sorted(LOW_RANK_TYPES))}, or another network with `quantize: false` and the VRAM for it")
    return problems

"""One schema for a preset: the `launcher:` block and the trainer keys the presets use.

Each key has a type, a range or a set of allowed values; blocks nest (`model_kwargs`,
`launcher.watchdog`). A preset is checked before anything heavy starts and every problem is
reported at once, each as

    config.process[0].train.steps = 'ten': not an integer; allowed: an integer >= 1

naming the key path, the value, what is allowed and, for an unknown key or value, the
closest known one. Values the trainer decides (qtypes, optimizers, network types, dtypes,
the keys each section reads) come from a `Vocabulary` read from the trainer itself
(launcher/runs/vocabulary.py); without a trainer checkout those parts are not checked.

A small declarative table, not a validation library: the messages above are the point, and
jsonschema or pydantic would need the same amount of code again to phrase their errors this
way, plus dependencies (compiled ones for pydantic) in a launcher that needs only PyYAML and
GitPython.
"""

import math
import re
import reprlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields

from launcher import trainer_rules
from launcher.runs import files
from launcher.signals.gpu_sources import SOURCES
from launcher.suggest import did_you_mean
from launcher.watchdog.policy import WatchdogConfig


@dataclass(frozen=True)
class Vocabulary:
    """What the trainer accepts, read from its checkout; None = not known, not checked."""

    section_keys: dict[str, set[str]] | None = None
    """{section: keys the trainer reads}; "process" is the process level."""
    model_kwargs: set[str] | None = None
    qtypes: set[str] | None = None
    optimizers: set[str] | None = None
    optimizer_prefixes: set[str] = field(default_factory=set)
    network_types: set[str] | None = None
    dtypes: set[str] | None = None
    jobs: set[str] | None = None


_PREVIEW = reprlib.Repr()
_PREVIEW.maxlevel, _PREVIEW.maxdict, _PREVIEW.maxlist, _PREVIEW.maxstring = 2, 3, 3, 60


def short(value) -> str:
    """A value as the message shows it: repr, cut to a readable length; a mapping or list is
    previewed a few items deep, never expanded whole (an alias bomb stands for billions)."""
    text = _PREVIEW.repr(value) if isinstance(value, (dict, list, tuple, set)) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def problem(path: str, value, what: str, allowed: str, known=()) -> str:
    hint = did_you_mean(value, known) if isinstance(value, str) and known else ""
    return f"{path} = {short(value)}: {what}; allowed: {allowed}{hint}"


class Spec:
    """One node of the schema: `check` yields a message per problem under `path`."""

    allowed = "anything"

    def check(self, value, path: str, vocab: Vocabulary) -> Iterator[str]:
        yield from ()


class Anything(Spec):
    pass


@dataclass(frozen=True)
class Boolean(Spec):
    allowed = "true or false"

    def check(self, value, path, vocab):
        if not isinstance(value, bool):
            yield problem(path, value, "not true/false", self.allowed)


@dataclass(frozen=True)
class Integer(Spec):
    minimum: int | None = None
    multiple_of: int | None = None
    maximum: int | None = None
    """What a human would still mean: a bound far above any real value, so a typo's extra digits are
    refused here, before the disk and memory arithmetic multiplies them."""

    @property
    def allowed(self) -> str:
        words = "an integer" if self.minimum is None else f"an integer >= {self.minimum}"
        return (words + (f", a multiple of {self.multiple_of}" if self.multiple_of else "")
                + (f", at most {self.maximum:,}" if self.maximum is not None else ""))

    def check(self, value, path, vocab):
        if isinstance(value, bool) or not isinstance(value, int):
            yield problem(path, value, "not an integer", self.allowed)
        elif self.minimum is not None and value < self.minimum:
            yield problem(path, value, "too small", self.allowed)
        elif self.maximum is not None and value > self.maximum:
            yield problem(path, value, "too large", self.allowed)
        elif self.multiple_of and value % self.multiple_of:
            below = value // self.multiple_of * self.multiple_of
            yield problem(path, value, f"not a multiple of {self.multiple_of} (use {below} or "
                          f"{below + self.multiple_of})", self.allowed)


@dataclass(frozen=True)
class Number(Spec):
    minimum: float | None = None
    maximum: float | None = None
    positive: bool = False

    @property
    def allowed(self) -> str:
        if self.positive:
            return "a number > 0" + (f", at most {self.maximum:g}" if self.maximum is not None else "")
        if self.minimum is not None and self.maximum is not None:
            return f"a number from {self.minimum} to {self.maximum}"
        return "a number" if self.minimum is None else f"a number >= {self.minimum}"

    def check(self, value, path, vocab):
        if isinstance(value, str) and _looks_numeric(value):
            yield problem(path, value, "text, not a number (YAML reads 1e-4 as text: write 1.0e-4)",
                          self.allowed)
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or (
                isinstance(value, float) and not math.isfinite(value)):
            yield problem(path, value, "not a number", self.allowed)
        elif (self.positive and value <= 0) or (self.minimum is not None and value < self.minimum) or (
                self.maximum is not None and value > self.maximum):
            yield problem(path, value, "out of range", self.allowed)


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Text(Spec):
    choices: tuple[str, ...] | Callable[[Vocabulary], set[str] | None] | None = None
    """Allowed values: fixed, or read from the trainer's vocabulary (None there: unchecked)."""
    prefixes: Callable[[Vocabulary], set[str]] | None = None
    """Values starting with one of these are allowed too (optimizer families)."""
    fold_case: bool = False
    max_chars: int | None = None

    def check(self, value, path, vocab):
        choices = self.choices(vocab) if callable(self.choices) else self.choices
        prefixes = self.prefixes(vocab) if self.prefixes else set()
        allowed = " | ".join(sorted(choices)) + "".join(f" | {p}..." for p in sorted(prefixes)) \
            if choices else "text" + (f" of at most {self.max_chars:,} characters" if self.max_chars else "")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not choices:
            yield problem(path, value, f"a number, not text (write it in quotes: '{value}')", allowed)
            return
        if not isinstance(value, str) or not value:
            yield problem(path, value, "not a non-empty text", allowed)
            return
        if self.max_chars is not None and len(value) > self.max_chars:
            yield problem(path, value, f"longer than {self.max_chars:,} characters ({len(value):,})", allowed)
            return
        word = value.lower() if self.fold_case else value
        if choices and word not in choices and not any(word.startswith(p) for p in prefixes):
            yield problem(path, value, "not one of the allowed values", allowed, choices)


@dataclass(frozen=True)
class PlainName(Spec):
    """A file or folder name the launcher creates: no separators, no `..`, portable on Windows."""

    MAX_CHARS = 100
    """The run folder and the LoRA files are named after it (`<name>/<name>_000001000.safetensors`, about
    30 characters more): 100 keeps each inside the 255 bytes a file name may have on common filesystems
    (even at 2 bytes a character in UTF-8), and a run folder path short enough for Windows' 260-character
    MAX_PATH where the output folder itself is not deep."""
    allowed = f"a plain folder name of at most {MAX_CHARS} characters (letters, digits, . _ - and spaces; no / \\ : or ..)"
    FORBIDDEN = re.compile(r'[<>:"/\\|?*\x00-\x1f]')

    def check(self, value, path, vocab):
        if not isinstance(value, str) or not value.strip():
            yield problem(path, value, "not a name", self.allowed)
        elif len(value) > self.MAX_CHARS:
            yield problem(path, value, f"{len(value)} characters; the run folder and LoRA files are named after it",
                          self.allowed)
        elif self.FORBIDDEN.search(value) or value.strip(". ") == "" or value != value.rstrip(". "):
            yield problem(path, value, "would not stay one folder inside the output folder", self.allowed)


@dataclass(frozen=True)
class SetByLauncher(Spec):
    """An environment variable naming a file `run` writes into the run folder: a preset's value
    would send the trainer's output elsewhere, past the run folder's link checks."""

    instead: str

    def check(self, value, path, vocab):
        yield f"{path} = {short(value)}: set by the launcher to a file in the run folder; {self.instead}"


ENV_ALLOWED = {
    # variable: why a preset may set it (none moves a file the trainer writes or reads, or the code it runs)
    "HF_HUB_OFFLINE": "keeps the Hugging Face libraries off the network (the tiny preset)",
    "HF_HUB_DISABLE_TELEMETRY": "only stops the Hugging Face libraries' usage reports",
    "TRANSFORMERS_OFFLINE": "keeps transformers off the network",
    "HF_DATASETS_OFFLINE": "keeps datasets off the network",
    "TOKENIZERS_PARALLELISM": "the tokenizers' thread pool, and its fork warning",
    "AITK_ALL_EXTENSIONS": "imports every extension's trainer process instead of the one the preset names",
    "AITK_PROFILE_SKIP": "the warm-up steps `run --profile` skips",
    "TRITON_CACHE_AUTOTUNING": "keeps Triton's autotuning results in its cache (set by `run`)",
    "TRITON_INTERPRET": "runs Triton kernels in its interpreter (debugging)",
    "CUDA_VISIBLE_DEVICES": "which NVIDIA GPU trains",
    "HIP_VISIBLE_DEVICES": "which AMD GPU trains",
    "ROCR_VISIBLE_DEVICES": "which AMD GPU trains",
    "HSA_OVERRIDE_GFX_VERSION": "the GPU target ROCm treats a consumer AMD card as",
    "CUDA_LAUNCH_BLOCKING": "synchronous kernel launches (debugging)",
    "AMD_SERIALIZE_KERNEL": "serialized kernel launches on ROCm (debugging)",
    "TORCH_BLAS_PREFER_HIPBLASLT": "the BLAS library PyTorch uses on ROCm",
    "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL": "the flash attention kernels of PyTorch on ROCm",
    "PYTORCH_CUDA_ALLOC_CONF": "the CUDA allocator's settings (`launcher.allocator` sets it)",
    "PYTORCH_HIP_ALLOC_CONF": "the ROCm allocator's settings (`launcher.allocator` sets it)",
    "OMP_NUM_THREADS": "CPU threads of the host-side work",
    "MKL_NUM_THREADS": "CPU threads of the host-side work",
}
ENV_ALLOWED_PREFIXES = {
    "AITK_TEST_": "read only by the tests' own interpreter wrappers (tests/test_atomic_save.py); the trainer ignores them",
}
"""The variables a preset's `launcher.env` may set. Any other could redirect what the trainer writes
or caches (AITK_QUANT_CACHE_DIR, AITK_TEXT_CACHE_DIR, TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR,
HF_HOME, TMPDIR: set those in the environment `run` starts from, where the launcher sees them too),
what it imports (PYTHONPATH) or the run folder's own files (the AITK_TELEMETRY* and AITK_PROFILE_*
variables `run` sets)."""


@dataclass(frozen=True)
class EnvName(Spec):
    """A `launcher.env` variable the allow list does not name."""

    def check(self, value, path, vocab):
        name = path.rsplit(".", 1)[-1]
        if name.startswith(tuple(ENV_ALLOWED_PREFIXES)):
            yield from EnvValue().check(value, path, vocab)
            return
        yield (f"{path} = {short(value)}: not a variable a preset may set (it could redirect the trainer's writes, "
               f"caches or imports; a cache folder is set in the environment `run` starts from){did_you_mean(name, ENV_ALLOWED)}; "
               f"allowed: {', '.join(sorted(ENV_ALLOWED))}, {', '.join(p + '...' for p in ENV_ALLOWED_PREFIXES)}")


@dataclass(frozen=True)
class Extension(Spec):
    """A caption file extension: a plain suffix, never a path."""

    allowed = "a plain file extension without the dot (txt, caption): letters, digits, _ and -"
    PLAIN = re.compile(r"[A-Za-z0-9_-]{1,32}")

    def check(self, value, path, vocab):
        if not isinstance(value, str) or not self.PLAIN.fullmatch(value):
            yield problem(path, value, "not a plain file extension", self.allowed)


@dataclass(frozen=True)
class Nullable(Spec):
    inner: Spec

    @property
    def allowed(self) -> str:
        return f"null or {self.inner.allowed}"

    def check(self, value, path, vocab):
        if value is not None:
            yield from self.inner.check(value, path, vocab)


@dataclass(frozen=True)
class Scalar(Spec):
    allowed = "text, a number or true/false"

    def check(self, value, path, vocab):
        if not isinstance(value, (str, int, float, bool)):
            yield problem(path, value, "not a single value", self.allowed)


@dataclass(frozen=True)
class EnvValue(Scalar):
    """One allowed `launcher.env` variable's value: a single line of text a process environment can hold."""

    allowed = "text, a number or true/false, without a NUL character"

    def check(self, value, path, vocab):
        found = list(super().check(value, path, vocab))
        if not found and "\0" in str(value):
            found.append(problem(path, value, "holds a NUL character, which no environment variable can", self.allowed))
        yield from found


@dataclass(frozen=True)
class ListOf(Spec):
    item: Spec
    min_items: int = 0

    @property
    def allowed(self) -> str:
        least = f" of at least {self.min_items} item{'s' if self.min_items > 1 else ''}" if self.min_items else ""
        return f"a list{least}, each {self.item.allowed}"

    def check(self, value, path, vocab):
        if not isinstance(value, list) or len(value) < self.min_items:
            yield problem(path, value, "not a list" if not isinstance(value, list) else "too few items",
                          self.allowed)
            return
        for index, item in enumerate(value):
            yield from self.item.check(item, f"{path}[{index}]", vocab)


@dataclass(frozen=True)
class OneOrList(Spec):
    """A single value or a list of them (dataset resolutions)."""

    item: Spec

    @property
    def allowed(self) -> str:
        return f"{self.item.allowed}, or a list of them"

    def check(self, value, path, vocab):
        yield from ListOf(self.item, 1).check(value if isinstance(value, list) else [value], path, vocab)


@dataclass(frozen=True)
class Block(Spec):
    """A mapping with typed keys; other keys are refused unless `extra` admits them."""

    keys: dict[str, Spec] = field(default_factory=dict)
    extra: str | Spec | None = None
    """None: closed; a Spec: any other key, with that value type; a section name: the other
    keys the trainer reads in that section (unchecked without a trainer checkout)."""
    required: tuple[str, ...] = ()

    allowed = "a mapping (key: value lines)"

    def check(self, value, path, vocab):
        if not isinstance(value, dict):
            yield problem(path, value, "not a mapping", self.allowed)
            return
        for key in self.required:
            if key not in value:
                yield f"{path}.{key} is missing; it is required"
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            spec = self.keys.get(key) or self._extra_spec(key, vocab)
            if spec is None:
                yield self._unknown(key, item, where, vocab)
            else:
                yield from spec.check(item, where, vocab)

    def _known(self, vocab: Vocabulary) -> set[str] | None:
        if isinstance(self.extra, str):
            known = (vocab.model_kwargs if self.extra == "model_kwargs"
                     else (vocab.section_keys or {}).get(self.extra))
            return None if known is None else set(known) | set(self.keys)
        return set(self.keys)

    def _extra_spec(self, key, vocab: Vocabulary) -> Spec | None:
        if isinstance(self.extra, Spec):
            return self.extra
        known = self._known(vocab)
        return Anything() if known is None or key in known else None

    def _unknown(self, key, item, where: str, vocab: Vocabulary) -> str:
        known = self._known(vocab) or set()
        who = "the trainer would silently ignore it" if isinstance(self.extra, str) else "not a setting"
        return f"{where} = {short(item)}: unknown key ({who}){did_you_mean(str(key), known)}"


@dataclass(frozen=True)
class Catalogued(Spec):
    """A setting of the catalogue (overlay/toolkit/settings.py), checked by the catalogue's own rule."""

    setting: object

    @property
    def allowed(self) -> str:
        return self.setting.allowed

    def check(self, value, path, vocab):
        why = self.setting.problem(value)
        if why:
            yield problem(path, value, why, self.allowed, self.setting.choices)


MODEL_KWARGS_BLOCK, LAUNCHER_BLOCK = "model_kwargs", "launcher"


def catalogued(block: str, refined: dict[str, Spec]) -> dict[str, Spec]:
    """The catalogue's settings of one block as specs; `refined` gives a nested block its own keys."""
    return {name: refined.get(name) or Catalogued(item)
            for name, item in trainer_rules.settings().CATALOGUE.items() if item.block == block}


def watchdog_block() -> Block:
    """`launcher.watchdog`: the keys and types of WatchdogConfig, non-negative numbers."""
    by_type = {"bool": Boolean(), "int": Integer(minimum=0), "float": Number(minimum=0),
               "str": Text(), "float | None": Nullable(Number(minimum=0)),
               "dict | None": Nullable(Block({name: Number(minimum=0) for name in ("clock_mhz", "power_w", "mem_load")},
                                             required=("clock_mhz", "power_w", "mem_load")))}
    keys = {item.name: by_type[str(item.type)] for item in fields(WatchdogConfig)}
    keys["source"] = Text(("auto", *SOURCES))
    keys["interval_s"] = Number(positive=True)
    keys["samples"] = Integer(minimum=1)
    return Block(keys)


MAX_STEPS = 10_000_000
"""Steps, save and sample cadences: a month of training at a step every quarter second."""
MAX_RANK = 1024
"""LoRA rank: far above the 16-128 LoRAs train at; at 1024 one LoRA of FLUX.2 [dev] is already about
12 GB (disk_budget.LORA_PARAMS_PER_RANK, bf16)."""
MAX_SHAPE = 65536
"""A size in flux2_params: ten times FLUX.2 [dev]'s widest (hidden_size 6144, context_in_dim 15360)."""
RESOLUTION = Integer(minimum=16, multiple_of=16, maximum=4096)
QTYPE = Text(lambda v: v.qtypes)
AUTO = "auto"
"""The launcher's own qtype: `run` turns it into a qtype from the self-test (launcher/selftest/verdict.py)
before the trainer reads the config, so only the transformer's qtype may say it."""
MODEL_QTYPE = Text(lambda v: v.qtypes | {AUTO} if v.qtypes is not None else None)
DTYPE = Text(lambda v: v.dtypes)


def launcher_block() -> Block:
    return Block(catalogued(LAUNCHER_BLOCK, {
        "env": Block({
            files.ENV_TELEMETRY: SetByLauncher("remove it (the rows go to <run>/trainer-telemetry.jsonl)"),
            files.ENV_TELEMETRY_INTERVAL: SetByLauncher("remove it and set launcher.telemetry.interval_s"),
            files.ENV_PROFILE_DIR: SetByLauncher("remove it (`run --profile N` writes to <run>/profile)"),
            files.ENV_PROFILE_STEPS: SetByLauncher("remove it and use `run --profile N`"),
            **dict.fromkeys(ENV_ALLOWED, EnvValue()),
        }, extra=EnvName()),
        # faster only grows the files; an hour apart the telemetry says nothing
        "telemetry": Block({"interval_s": Number(minimum=0.1, maximum=3600)}),
        "watchdog": watchdog_block(),
        "card": Text(max_chars=200),
    }))


FLUX2_PARAMS = Block({
    # the trainer's Flux2Params (extensions_built_in/diffusion_models/flux2/src/model.py): the transformer's shape
    **{name: Integer(minimum=1, maximum=MAX_SHAPE) for name in ("in_channels", "context_in_dim", "hidden_size",
                                                                "num_heads", "depth", "depth_single_blocks")},
    "theta": Integer(minimum=1, maximum=10**9),
    "axes_dim": ListOf(Integer(minimum=1, maximum=MAX_SHAPE), min_items=1),
    "mlp_ratio": Number(positive=True, maximum=64),
})
MAX_PROMPT_CHARS = 128 * 1024
"""A sample prompt: the text encoder reads at most a few hundred tokens of it."""
MAX_TRIGGER_CHARS = 200

MODEL_KWARGS = Block(catalogued(MODEL_KWARGS_BLOCK, {"flux2_params": FLUX2_PARAMS, "ae_params": Block(extra=Anything())}),
                     extra="model_kwargs")
"""The project's model_kwargs (overlay/toolkit/settings.py) plus the trainer's own keys (the vocabulary)."""

PROCESS = Block({
    "type": Text(),
    "training_seed": Integer(minimum=0, maximum=2**32 - 1),
    "training_folder": Text(),
    "trigger_word": Nullable(Text(max_chars=MAX_TRIGGER_CHARS)),
    "network": Block({
        "type": Text(lambda v: v.network_types, fold_case=True),
        "linear": Integer(minimum=1, maximum=MAX_RANK), "linear_alpha": Number(positive=True, maximum=65536),
        "conv": Integer(minimum=1, maximum=MAX_RANK), "conv_alpha": Number(positive=True, maximum=65536),
    }, extra="network"),
    "save": Block({"dtype": DTYPE, "save_every": Integer(minimum=1, maximum=MAX_STEPS),
                   "max_step_saves_to_keep": Integer(minimum=1, maximum=1000)}, extra="save"),
    "datasets": ListOf(Block({
        "folder_path": Text(), "caption_ext": Extension(), "cache_latents_to_disk": Boolean(),
        "caption_dropout_rate": Number(minimum=0, maximum=1), "resolution": OneOrList(RESOLUTION),
        "bucket_tolerance": Integer(minimum=1, maximum=1024),
    }, extra="datasets"), min_items=1),
    "train": Block({
        "batch_size": Integer(minimum=1, maximum=1024), "steps": Integer(minimum=1, maximum=MAX_STEPS),
        "gradient_accumulation": Integer(minimum=1, maximum=1024),
        "gradient_accumulation_steps": Integer(minimum=1, maximum=1024),
        "lr": Number(positive=True, maximum=10), "dtype": DTYPE,
        "optimizer": Text(lambda v: v.optimizers, lambda v: v.optimizer_prefixes, fold_case=True),
        **{flag: Boolean() for flag in ("train_unet", "train_text_encoder", "gradient_checkpointing",
                                        "cache_text_embeddings", "disable_sampling")},
    }, extra="train"),
    "model": Block({
        "name_or_path": Text(), "arch": Text(), "qtype": MODEL_QTYPE, "qtype_te": QTYPE,
        **{flag: Boolean() for flag in ("quantize", "quantize_te", "low_vram", "layer_offloading")},
        "model_kwargs": MODEL_KWARGS,
    }, extra="model"),
    "sample": Block({"sample_every": Integer(minimum=1, maximum=MAX_STEPS), "sample_steps": Integer(minimum=1, maximum=1000),
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
        return [f"the preset is {short(data)}, not a mapping; it needs `job:`, `config:` and optionally `launcher:`"]
    return [*preset_schema().check(data, "", vocab), *quantized_network_problems(data, vocab),
            *flux2_params_problems(data)]


def flux2_params_problems(data: dict) -> list[str]:
    """Shapes the trainer's Flux2 refuses as it builds the model (minutes in): heads that do not
    divide the hidden size, rotary axes that do not add up to the head size."""
    problems = []
    for index, process in enumerate(_processes(data)):
        kwargs = (process.get("model") or {}).get("model_kwargs") if isinstance(process.get("model"), dict) else None
        params = kwargs.get("flux2_params") if isinstance(kwargs, dict) else None
        if not isinstance(params, dict) or any(problem for problem in FLUX2_PARAMS.check(params, "", Vocabulary())):
            continue
        where = f"config.process[{index}].model.model_kwargs.flux2_params"
        hidden, heads = params.get("hidden_size", 6144), params.get("num_heads", 48)
        axes = params.get("axes_dim", [32, 32, 32, 32])
        if hidden % heads:
            problems.append(f"{where}: hidden_size {hidden} is not a multiple of num_heads {heads}; the trainer "
                            "refuses this shape when it builds the model")
        elif sum(axes) != hidden // heads:
            problems.append(f"{where}: axes_dim {axes} adds up to {sum(axes)}, not hidden_size / num_heads = "
                            f"{hidden // heads}; the trainer refuses this shape when it builds the model")
    return problems


def _processes(data: dict) -> list[dict]:
    config = data.get("config")
    process = config.get("process") if isinstance(config, dict) else None
    return [item for item in process if isinstance(item, dict)] if isinstance(process, list) else []


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
        qtypes = trainer_rules.qtypes()
        unknown = vocab.network_types is not None and str(kind).lower() not in vocab.network_types  # said above
        if isinstance(kind, str) and not unknown and kind.lower() not in LOW_RANK_TYPES and model.get("quantize") is True \
                and (qtype in (qtypes.FALLBACK, *qtypes.QTYPES) or qtype == AUTO):
            problems.append(
                f"config.process[{index}].network.type = {short(kind)}: the 4-bit base (model.qtype {qtype}) cannot "
                f"train it (it adds its delta to the quantized weight, which fails at step 1); allowed there: "
                f"{' | '.join(sorted(LOW_RANK_TYPES))}, or another network with `quantize: false` and the VRAM for it")
    return problems

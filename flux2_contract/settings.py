"""Every setting the trainer reads, in one table: its type, allowed values, default, one line of doc,
and who turns its `auto` into a value.

The `model_kwargs` block of a preset holds them (read by the patched trainer); `qtype`, ai-toolkit's
own key of the model config, is here for who resolves its `auto` and how a resume may change it.
The keys only the launcher reads (the preset's `launcher:` block) are the launcher's own, in this
table's form (launcher/runs/launcher_settings.py). The launcher's schema checks a preset with
`Setting.problem`, `run` resolves every `auto` marked `RUN` and writes every model_kwargs setting as
a concrete value into the run's config (`complete`), and the trainer reads them back with `read`:
one rule, one default, one route. docs/options.md is generated from both tables
(`python -m launcher.options_doc`).

Stdlib only: part of the contract package, which the launcher imports without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

AUTO = "auto"
RUN = "`python -m launcher run` (from the self-test)"
"""Who resolves an `auto` before the trainer starts; the trainer refuses to read one."""
MODEL_KWARGS, MODEL = "model_kwargs", "model"
SAME_CODES = "to a qtype that stores the same 4-bit codes (flux2_contract/qtypes.py same_codes)"
"""A resume may change the setting, but only so: the saved LoRA was trained on those codes."""


class SettingError(ValueError):
    """A setting's value the table does not allow; the message names the key and what is allowed."""


@dataclass(frozen=True)
class Setting:
    name: str
    block: str  # MODEL_KWARGS, MODEL (ai-toolkit's own key of the model config), or the launcher's own
    kind: str  # bool | int | number | choice | text | mapping
    default: Any
    doc: str
    choices: Tuple[str, ...] = ()
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    above: Optional[float] = None  # an exclusive lower bound (a budget: any size above nothing)
    auto: Optional[str] = None
    """Who turns `auto` into a value (RUN, or a sentence); None: `auto` is not allowed."""
    written_by_run: bool = False
    """`run` writes it into every run's config (from its flags, the workdir and the run folder): what
    the trainer would otherwise have to learn from an environment variable."""
    resume_may_change: Any = False
    """How the run is carried out, not what it trains: `run --resume` accepts a change without a flag
    (True), or only of one kind (a sentence: SAME_CODES)."""

    @property
    def allowed(self) -> str:
        """What a preset may write; `auto` included where `run` resolves it."""
        words = self.values
        return (f"auto, {words}" if self.kind == "bool" else f"auto | {words}") if self.auto else words

    @property
    def values(self) -> str:
        """The concrete values: what the trainer may be handed."""
        return {
            "bool": "true or false",
            "int": "a whole number" + (f" >= {self.minimum:g}" if self.minimum is not None else "")
            + (f", at most {self.maximum:,}" if self.maximum is not None else ""),
            "number": "a number" + (f" >= {self.minimum:g}" if self.minimum is not None else "")
            + (f" > {self.above:g}" if self.above is not None else "")
            + (f", at most {self.maximum:g}" if self.maximum is not None else ""),
            "choice": " | ".join(self.choices),
            "text": "a non-empty text",
            "mapping": "a mapping (key: value lines)",
        }[self.kind]

    def problem(self, value: Any) -> Optional[str]:
        """Why `value` is not allowed here, or None. `null` stands for the default."""
        value = self.normal(value)
        if value is None or (value == AUTO and self.auto):
            return None
        if self.kind == "bool":
            return None if isinstance(value, bool) else "not true/false"
        if self.kind in ("int", "number"):
            whole = isinstance(value, int) and not isinstance(value, bool)
            number = whole or (isinstance(value, float) and value == value and abs(value) != float("inf"))
            if not (whole if self.kind == "int" else number):
                return "not a whole number" if self.kind == "int" else "not a number"
            return None if self._in_range(value) else "out of range"
        if self.kind == "choice":
            return None if value in self.choices else "not one of the allowed values"
        if self.kind == "text":
            return None if isinstance(value, str) and value else "not a non-empty text"
        return None if isinstance(value, dict) else "not a mapping"

    def normal(self, value: Any) -> Any:
        """YAML 1.1 reads a bare `off` as false: where `off` is a choice, false means it."""
        return "off" if value is False and "off" in self.choices else value

    def _in_range(self, value) -> bool:
        return ((self.minimum is None or value >= self.minimum) and (self.above is None or value > self.above)
                and (self.maximum is None or value <= self.maximum))


def _settings(*items: Setting) -> Dict[str, Setting]:
    return {item.name: item for item in items}


def _kw(name, kind, default, doc, **more) -> Setting:
    return Setting(name, MODEL_KWARGS, kind, default, doc, **more)


def _md(name, kind, default, doc, **more) -> Setting:
    return Setting(name, MODEL, kind, default, doc, **more)


CATALOGUE: Dict[str, Setting] = _settings(
    # ai-toolkit's own key, which `run` resolves: the trainer reads it as ModelConfig.qtype
    _md("qtype", "text", None, "the transformer's quantization: int4_fused or int4_w4a8 (flux2_contract/qtypes.py, their "
        "kernel from the model_kwargs below), or one of the trainer's (uint4, qfloat8, ...); auto: the self-test's "
        "fastest 4-bit path that fits the card", auto=RUN, resume_may_change=SAME_CODES),
    # where the model and its parts come from
    _kw("text_encoder_path", "text", None, "the text encoder folder: Mistral3, FLUX.2 klein's Qwen3 (set by `run` from --text-encoder)",
        resume_may_change=True),
    _kw("flux2_params", "mapping", None, "the transformer's shape (Flux2Params); unset: FLUX.2 [dev]"),
    _kw("ae_params", "mapping", None, "the autoencoder's shape (AutoEncoderParams); unset: FLUX.2's"),
    # walls 3-4: the text phase
    _kw("streamed_text_encoder", "bool", True, "walls 3-4: embed every prompt first, the encoder streamed layer "
        "by layer, before the transformer loads"),
    _kw("text_phase_budget_mib", "int", 1024, "host RAM one pass of the streamed encoder may hold", minimum=1,
        maximum=4 * 2**20),
    _kw("text_embedding_cache_dir", "text", None, "the prompt embedding cache; `run` writes the workdir's (or "
        "$AITK_TEXT_CACHE_DIR of its shell) where the preset sets none; unset: text_cache beside the run folder",
        written_by_run=True, resume_may_change=True),
    # walls 1, 2, 8, 9: loading
    _kw("streamed_loader", "bool", True, "wall 1: read the checkpoint one block at a time"),
    _kw("quantize_device", "choice", "cpu", "where blocks are quantized: the GPU is faster, one block there "
        "at a time", choices=("cpu", "gpu")),
    _kw("allow_unquantized_block_linears", "bool", False, "train on although a block Linear was left in bf16"),
    _kw("quantized_cache", "bool", True, "wall 8: keep the quantized transformer in a code-free cache"),
    _kw("quantized_cache_dir", "text", None, "the quantized cache; `run` writes the workdir's (or "
        "$AITK_QUANT_CACHE_DIR of its shell) where the preset sets none; unset: quant_cache beside the run folder",
        written_by_run=True, resume_may_change=True),
    _kw("cache_staging_mib", "int", 256, "host RAM of the staging buffers a cache read to the GPU uses",
        minimum=4, maximum=65536),
    _kw("pinned_staging", "bool", True, "pin the staging buffers (faster copies to the GPU)"),
    _kw("resident_after_te_cache", "bool", True, "wall 9: the transformer goes to the GPU once the text "
        "embeddings are cached, and stays"),
    _kw("blocks_to_device", "bool", True, "each quantized block is placed where training needs it as it "
        "is built"),
    _kw("stay_placed", "bool", True, "the placed transformer stays on the GPU while the VAE works"),
    _kw("cached_data_in_process", "bool", True, "no dataloader workers when every item is a cached file"),
    # wall 6
    _kw("lora_sampler", "bool", True, "wall 6: FLUX.2 samples through the LoRA sampler"),
    # walls 5 and 11: the memory plan
    _kw("memory_plan", "choice", "off", "walls 5/11: auto plans, per launch, which blocks stay on the GPU and "
        "which stream from pinned host memory, from the VRAM free when the model loads; off: all resident",
        choices=("auto", "off"), resume_may_change=True),
    _kw("stream_mode", "choice", "serialized", "how streamed blocks are copied: serialized, or overlapped with "
        "the compute (NVIDIA only; wall 5)", choices=("serialized", "overlapped"), auto=RUN,
        resume_may_change=True),
    _kw("vram_budget_gib", "number", None, "the memory plan's budget, and the allocator's cap; unset: the "
        "VRAM free at load time", above=0, maximum=1024,
        resume_may_change=True),
    _kw("vram_margin_gib", "number", 1.0, "VRAM the plan leaves free (allocator slack)", minimum=0, maximum=1024,
        resume_may_change=True),
    _kw("hold_8bit_copies", "bool", True, "int4_w4a8 under the memory plan: hold 8-bit copies of resident blocks' "
        "weights in the VRAM the plan leaves once activations are kept, forward copies first (those matmuls skip "
        "requantizing the 4-bit weight); a block holding both copies frees its 4-bit weights, which the plan counts "
        "back", resume_may_change=True),
    _kw("launch_plan", "text", None, "the memory plan `run` made for the preset's vram_budget_gib, with the budget "
        "bytes and run shape it was made for, as one line of JSON: the trainer carries it out where it finds the "
        "same, else plans again and says so; unset (no vram_budget_gib): the trainer plans from the VRAM free at "
        "load time", written_by_run=True, resume_may_change=True),
    # wall 11 and the 4-bit kernels
    _kw("compile_blocks", "bool", False, "wall 11: torch.compile each transformer block class (fuses the "
        "elementwise chains around the 4-bit matmuls)", auto=RUN, resume_may_change=True),
    _kw("w4a8_activations", "choice", None, "int4_w4a8's 8-bit activations; unset: fp8 where the GPU has FP8 "
        "matrix units (NVIDIA sm_89+, AMD gfx12), else int8", choices=("fp8", "int8"), auto=RUN),
    _kw("w4a8_gemm", "choice", "triton", "int4_w4a8's GEMM: Triton, or torch._scaled_mm (FP8 on NVIDIA; fast "
        "accumulation in the forward, not in the input gradient), each on 8-bit weight slices; or in_register: a "
        "Triton GEMM that reads the 4-bit weight itself (forward and recompute; the input gradient through "
        "Triton's sliced path)", choices=("triton", "scaled_mm", "in_register"),
        auto=RUN),
    _kw("int4_chunk_mib", "int", None, "MiB of weight one sliced 4-bit matmul dequantizes at a time; unset: "
        "the qtype's own (64 int4_fused, 256 int4_w4a8)", minimum=1, maximum=65536),
    _kw("int4_kernel", "bool", True, "false: the plain-PyTorch reference of the 4-bit Linears even on a GPU "
        "(debugging)"),
    _kw("lora_matmuls", "choice", "bf16", "the precision of the LoRA's two matmuls, its weights kept in float32: "
        "bf16 (under autocast), tf32 (`run` sets TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 for the trainer: NVIDIA's TF32 "
        "tensor cores, Ampere and newer; float32 elsewhere) or fp32 (the trainer's own)",
        choices=("bf16", "tf32", "fp32"), resume_may_change=True),
    # ROCm's libraries, measured by the self-test
    _kw("rocm_blas", "choice", "default", "ROCm: the library of the bf16 matmuls (the 4-bit path's, after "
        "dequantizing): hipblas, hipblaslt, or default (PyTorch's pick for the GPU); unset or auto: the faster "
        "in the self-test; nothing changes on NVIDIA or the CPU", choices=("default", "hipblas", "hipblaslt"),
        auto=RUN),
    _kw("sdpa_kernels", "choice", "default", "the attention kernels the GPU runs at FLUX.2's shape: default (a "
        "flash or memory-efficient kernel ran), experimental (one ran only with "
        "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1, which `run` then sets for the trainer), or math (only "
        "PyTorch's math attention: the memory plan holds its attention matrices); auto: what the self-test found",
        choices=("default", "experimental", "math"), auto=RUN, resume_may_change=True),
    _kw("miopen_find_mode", "choice", "default", "ROCm: MIOpen's search for a convolution's kernel: default, or "
        "fast (`run` sets MIOPEN_FIND_MODE=FAST for the trainer: no benchmarking search); auto: fast where the "
        "self-test's first convolution call was slow", choices=("default", "fast"), auto=RUN,
        resume_may_change=True),
    # what `run` hands the trainer for this launch: the run folder's files and the profiler
    _kw("telemetry_file", "text", None, "the JSONL file of the in-process telemetry rows (the run folder's "
        "trainer-telemetry.jsonl); unset: no telemetry", written_by_run=True, resume_may_change=True),
    _kw("telemetry_interval_s", "number", 10, "seconds between telemetry rows, 0: a row per step (`run` writes "
        "launcher.telemetry.interval_s)", minimum=0, maximum=3600, written_by_run=True, resume_may_change=True),
    _kw("profile_steps", "int", 0, "`run --profile N`: torch.profiler over N whole steps; 0: off", minimum=0,
        maximum=10**6, written_by_run=True, resume_may_change=True),
    _kw("profile_dir", "text", None, "where the profile goes (the run folder's profile/); unset: profile/ in the "
        "trainer's folder", written_by_run=True, resume_may_change=True),
    _kw("profile_skip", "int", 2, "warm-up steps before the profiled ones (the first compile and autotune kernels "
        "and grow the allocator)", minimum=0, maximum=10**6, resume_may_change=True),
    _kw("rank_state_file", "text", None, "`run --gpus N`: each rank rewrites <stem>.rank<R>.json beside it at "
        "each collective, for the rank watch; unset: no state files", written_by_run=True, resume_may_change=True),
    _kw("all_extensions", "bool", False, "import every extension's process when the job starts (as before amd-fork "
        "0025, upstream-main 0023), not only the ones the job runs; any process setting it decides",
        resume_may_change=True),
)


def model_kwargs_settings() -> Dict[str, Setting]:
    return {name: item for name, item in CATALOGUE.items() if item.block == MODEL_KWARGS}


def cache_folder(model_kwargs: Dict[str, Any], name: str, training_folder: Optional[str], sibling: str) -> Optional[Path]:
    """A cache folder: the setting `name` (`run` writes the workdir's), else `sibling` beside the run
    folder, which the runs of one output folder share; None when neither is known."""
    if read(model_kwargs, name):
        return Path(read(model_kwargs, name))
    if training_folder:
        return Path(training_folder).resolve().parent / sibling
    return None


def read(model_kwargs: Dict[str, Any], name: str) -> Any:
    """The value of one model_kwargs setting: the config's, else the table's default; checked."""
    setting = CATALOGUE[name]
    value = setting.normal(model_kwargs.get(name))
    if value == AUTO and setting.auto == RUN:
        raise SettingError(f"model_kwargs {name}: auto is resolved by {setting.auto} before the trainer starts; "
                           f"a config given to the trainer directly needs {setting.values}")
    why = setting.problem(value)
    if why:
        raise SettingError(f"model_kwargs {name}: {value!r} is {why}; allowed: {setting.values}")
    return setting.default if value is None else value


def complete(model_kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """model_kwargs with every setting that has a default present: the config's value or the default.
    A setting whose default is "unset" stays absent, and a key the table does not know is kept as
    it is (the trainer's own)."""
    done = dict(model_kwargs)
    for name in model_kwargs_settings():
        value = read(model_kwargs, name)
        if value is not None:
            done[name] = value
    return done

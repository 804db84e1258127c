"""Every `auto` of a rendered config resolved in one place, before the trainer starts.

`run` reads the self-test report once (launcher/selftest/verdict.py `Verdicts`), asks the memory
planner once per budget and run shape (launcher/runs/memory_plan.py `Planner`), and turns each
`auto` the catalogue (flux2_contract/settings.py) gives to `run` into a value, one resolver per
setting: the qtype, int4_w4a8's kernel (w4a8_activations and w4a8_gemm, decided together),
stream_mode, sdpa_kernels, compile_blocks, rocm_blas, miopen_find_mode, and the launcher block's
sampling. Then every model_kwargs setting of the catalogue is written as a concrete value into the
run's config.yaml; the trainer reads them back through the same catalogue, never an `auto` and never
an environment variable. The two settings PyTorch's and MIOpen's libraries read as variables
(sdpa_kernels: experimental, miopen_find_mode: fast) become the trainer's environment from the
resolved config (launcher/runs/trainer_env.py `from_settings`).
"""

from dataclasses import dataclass
from functools import partial
from pathlib import Path

from flux2_contract import qtypes, settings
from launcher.runs import memory_plan, trainer_env
from launcher.runs.schema import AUTO
from launcher.selftest.verdict import (FIND_MODE_DEFAULT, ROCM_BLAS_DEFAULT, SDPA_DEFAULT, SERIALIZED, Verdicts,
                                       attention_from, blas_from, compile_from, find_mode_from, streaming_from)

KERNEL_KEYS = ("w4a8_activations", "w4a8_gemm")
"""The model_kwargs that pick int4_w4a8's kernel: `run` gives them values from the self-test."""


@dataclass(frozen=True)
class Resolution:
    config: dict
    """The config resolved: every `auto` `run` decides given its value, every catalogue setting concrete."""
    lines: list[str]
    """What `run` prints about each choice, then the memory plan's lines."""
    planner: memory_plan.Planner
    """The plans this launch made (each card's plan of `run --gpus N` asks it too)."""
    launch_plans: list[str | None]
    """Per process, the plan `run` hands the trainer (model_kwargs launch_plan, files.hand_over)."""
    env: dict[str, str]
    """The variables the resolved settings give the trainer process (trainer_env.from_settings)."""


def resolve_run(rendered: dict, verdicts: Verdicts, sampling_setting: str, preset_path: Path) -> Resolution:
    """The rendered config resolved from the self-test report this launch read (a new config:
    `rendered` stays as it was), with its memory plans checked; LauncherError where the trainer
    would refuse a budget."""
    planner = memory_plan.Planner()
    config, sampled = sampling(rendered, verdicts, sampling_setting)
    # in this order: the stream mode sets the buffer and the attention kernels the fixed memory of any
    # plan (qtype's among them), and the kernel follows the qtype
    resolvers = {"streams": stream_mode, "attends": sdpa_kernels,
                 "qtype": partial(qtype, planner=planner), "kernel": w4a8_kernel,
                 "compiled": compile_blocks, "blas": rocm_blas, "searched": miopen_find_mode}
    said = {name: [] for name in resolvers}
    processes = []
    for process in config["config"]["process"]:
        process = with_settings(process, {})
        for name, resolver in resolvers.items():
            process, line = resolver(process, verdicts)
            said[name].append(line)
        processes.append(with_concrete_settings(process))
    config = {**config, "config": {**config["config"], "process": processes}}
    chosen = [line for pair in zip(said["qtype"], said["kernel"]) for line in pair if line]
    lines = [line for line in (*chosen, sampled, *(last(said[name]) for name in ("streams", "attends", "compiled",
                                                                              "blas", "searched"))) if line]
    lines += memory_plan.check_plans(config, preset_path, planner)
    return Resolution(config, lines, planner, memory_plan.launch_plans(config, planner),
                      trainer_env.from_settings(config))


Resolved = tuple[dict, str | None]
"""What a resolver returns: the process with its setting decided (a new dict), and the line `run`
says of the choice (None where there is nothing to say)."""


def last(lines) -> str | None:
    """The line of the last process that had one (one line per setting, as the presets have one process)."""
    said = [line for line in lines if line]
    return said[-1] if said else None


def kwargs_of(process: dict) -> dict:
    return (process.get("model") or {}).get("model_kwargs") or {}


def with_settings(process: dict, kwargs: dict, **model) -> dict:
    """`process` with these model_kwargs values and model keys: a new process, the given one unchanged
    (a process without a model gains none)."""
    if process.get("model") is None:
        return process
    given = process["model"]
    return {**process, "model": {**given, **model, "model_kwargs": {**(given.get("model_kwargs") or {}), **kwargs}}}


def with_concrete_settings(process: dict) -> dict:
    """`process` with its model_kwargs made concrete (`concrete`): a new process, the given one unchanged."""
    if process.get("model") is None:
        return process
    return {**process, "model": {**process["model"], "model_kwargs": concrete(kwargs_of(process))}}


def unset(kwargs: dict, values: dict) -> dict:
    """The keys of `values` the preset leaves to `auto` (or unset); a value the preset names stays."""
    return {key: value for key, value in values.items() if kwargs.get(key, AUTO) == AUTO}


def qtype(process: dict, verdicts: Verdicts, planner: memory_plan.Planner) -> Resolved:
    """`qtype: auto` -> the self-test's fastest passing qtype with its kernel, else a fallback that
    can stream where the process's memory plan may stream blocks on the self-test's card."""
    model = process.get("model") or {}
    if model.get("qtype") != AUTO:
        return process, None
    choice = verdicts.qtype(streams=memory_plan.streams_on(process, verdicts.card_vram_gib, planner))
    return with_settings(process, unset(kwargs_of(process), choice.kernel), qtype=choice.qtype), choice.line


def w4a8_kernel(process: dict, verdicts: Verdicts) -> Resolved:
    """int4_w4a8's `auto` (or unset) kernel, both keys at once: they name one kernel together."""
    model, kwargs = process.get("model") or {}, kwargs_of(process)
    name = model.get("qtype")
    if not (qtypes.has_eight_bit_kernel(name) and any(kwargs.get(key, AUTO) == AUTO for key in KERNEL_KEYS)):
        return process, None
    kernel, why = verdicts.w4a8_kernel()
    kwargs = {**kwargs, **unset(kwargs, kernel)}
    return (with_settings(process, kwargs),
            f"{name} kernel -> {kwargs.get('w4a8_activations')} {kwargs.get('w4a8_gemm')}: {why}")


def stream_mode(process: dict, verdicts: Verdicts) -> Resolved:
    """`stream_mode: auto` (or unset) of a process with `memory_plan: auto` -> serialized or
    overlapped; no line where the process does not plan or names its mode."""
    kwargs = kwargs_of(process)
    if kwargs.get("memory_plan") != AUTO or kwargs.get("stream_mode", AUTO) != AUTO:
        return process, None
    mode, why = verdicts.decide(streaming_from, SERIALIZED)
    return with_settings(process, {"stream_mode": mode}), f"stream_mode auto -> {mode}: {why}"


def compile_blocks(process: dict, verdicts: Verdicts) -> Resolved:
    """`compile_blocks: auto` -> true or false; a warning where a preset says true and the check did
    not pass here; no line where the process neither compiles nor says auto."""
    kwargs = kwargs_of(process)
    if kwargs.get("compile_blocks") != AUTO and kwargs.get("compile_blocks") is not True:
        return process, None
    compiled, why = verdicts.decide(compile_from, False)
    if kwargs["compile_blocks"] == AUTO:
        return (with_settings(process, {"compile_blocks": compiled}),
                f"compile_blocks auto -> {str(compiled).lower()}: {why}")
    if not compiled:
        return process, (f"warning: compile_blocks: true, but the self-test's compile check has not passed here ({why}); "
                         "a compile failure on the first step falls back to uncompiled blocks")
    return process, None


def _from_verdict(process: dict, verdicts: Verdicts, name: str, rule, default: str, shown) -> Resolved:
    """`name: auto` (or unset) -> the value `rule` takes from the self-test; the line where
    `shown(value)` (a ROCm setting changes nothing elsewhere, so there it goes unsaid)."""
    if process.get("model") is None or kwargs_of(process).get(name, AUTO) != AUTO:
        return process, None
    value, why = verdicts.decide(rule, default)
    return with_settings(process, {name: value}), f"{name} auto -> {value}: {why}" if shown(value) else None


def rocm_blas(process: dict, verdicts: Verdicts) -> Resolved:
    """`rocm_blas` -> hipblas, hipblaslt or default: the faster library the self-test timed on ROCm."""
    return _from_verdict(process, verdicts, "rocm_blas", blas_from, ROCM_BLAS_DEFAULT, lambda _: verdicts.on_hip)


def sdpa_kernels(process: dict, verdicts: Verdicts) -> Resolved:
    """`sdpa_kernels` -> default, experimental or math: the attention kernels that ran; said on ROCm,
    or anywhere they are other than the default."""
    return _from_verdict(process, verdicts, "sdpa_kernels", attention_from, SDPA_DEFAULT,
                         lambda value: verdicts.on_hip or value != SDPA_DEFAULT)


def miopen_find_mode(process: dict, verdicts: Verdicts) -> Resolved:
    """`miopen_find_mode` -> default or fast: from the time of MIOpen's first convolution on ROCm."""
    return _from_verdict(process, verdicts, "miopen_find_mode", find_mode_from, FIND_MODE_DEFAULT,
                         lambda _: verdicts.on_hip)


def sampling(config: dict, verdicts: Verdicts, setting: str) -> tuple[dict, str | None]:
    """In-training sampling (wall 6) stays on only where the self-test's sampling check passed for
    this trainer build, or when the preset says `launcher: {sampling: force}`; otherwise it is
    switched off in the config returned (a new one; `config` stays as it was). No line when no
    process samples."""
    sampled = [not (p.get("train") or {}).get("disable_sampling", False) for p in config["config"]["process"]]
    if not any(sampled):
        return config, None
    if setting == "force":
        return config, "in-training sampling on: forced by the preset (launcher: {sampling: force})"
    passed, why = verdicts.sampling()
    if passed:
        return config, f"in-training sampling on: {why}"
    processes = [{**process, "train": {**(process.get("train") or {}), "disable_sampling": True}} if samples else process
                 for process, samples in zip(config["config"]["process"], sampled)]
    return ({**config, "config": {**config["config"], "process": processes}},
            f"in-training sampling off: {why}; `python -m launcher selftest` checks that sampling completes here, "
            "or set `launcher: {sampling: force}` in the preset")


def concrete(kwargs: dict) -> dict:
    """model_kwargs with every catalogue setting given its value: an `auto` left where it does not
    apply (a stream mode without a plan, a kernel of another qtype) takes the default."""
    unused = {name for name, item in settings.CATALOGUE.items() if item.auto == settings.RUN and kwargs.get(name) == settings.AUTO}
    return settings.complete({key: value for key, value in kwargs.items() if key not in unused})

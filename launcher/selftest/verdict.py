"""The self-test's result in the workdir, and what it decides: the qtype behind `qtype: auto` and
its kernel, the stream mode behind `model_kwargs: {stream_mode: auto}` of a memory plan, whether
`model_kwargs: {compile_blocks: auto}` compiles the transformer blocks, the ROCm BLAS library behind
`model_kwargs: {rocm_blas: auto}`, and in-training sampling.

`python -m launcher selftest` writes `<workdir>/selftest.json` (written by
`launcher.in_trainer.selftest.runner` under the trainer's interpreter, stamped here with the trainer
build it tested). A preset's `qtype: auto` becomes the fastest 4-bit qtype that passed there, with
the model_kwargs that pick its kernel; where nothing passed it becomes the fork's own `uint4`, or,
where a memory plan may stream blocks, `int4_fused` on its plain-PyTorch path (uint4 cannot
stream); `run` says in one line why. The qtype facts come from the trainer's own table
(overlay/toolkit/qtypes.py, through `launcher.trainer_rules`).
"""

import hashlib
import json
from dataclasses import dataclass, field

from launcher import trainer_rules
from launcher.envs.workdir import Workdir, read_state
from launcher.runs.memory_plan import streams_on
from launcher.runs.schema import AUTO

QTYPES = trainer_rules.qtypes()
FALLBACK_QTYPE = QTYPES.FALLBACK
STREAMING_FALLBACK = QTYPES.STREAMING_FALLBACK
HOW_TO_TEST = "`python -m launcher selftest` (a few minutes) tests the 4-bit kernels on this GPU"
FALLBACK_COST = "uint4 steps 1.73x the int4_fused time, 2.04x bf16 (H200, full width; bench/RESULTS.md)"
REFERENCE_COST = "the plain-PyTorch path steps 1.92x int4_fused's Triton time (H200, full width; bench/RESULTS.md)"
SERIALIZED, OVERLAPPED = "serialized", "overlapped"
ROCM_BLAS_DEFAULT = "default"
KERNEL_KEYS = ("w4a8_activations", "w4a8_gemm")
"""The model_kwargs that pick int4_w4a8's kernel: `run` gives them values from the self-test."""


@dataclass(frozen=True)
class QtypeChoice:
    qtype: str
    kernel: dict = field(default_factory=dict)
    """The model_kwargs that pick its kernel (toolkit/settings.py), written into the run's config."""
    line: str | None = None
    """What `run` prints about the choice, or None when the preset named the qtype itself."""


def trainer_build(workdir: Workdir) -> dict:
    """What setup put in the workdir (target, commit, overlay, a hash of the patch list):
    a self-test is valid for this build only."""
    state = read_state(workdir.state_file)
    patches = json.dumps(state.get("patches") or {}, sort_keys=True).encode()
    return {"target": state.get("target"), "commit": state.get("commit"), "overlay": state.get("overlay"),
            "patches_sha256": hashlib.sha256(patches).hexdigest(), "patch_count": len(state.get("patches") or {})}


def load_result(workdir: Workdir) -> dict | None:
    try:
        result = json.loads(workdir.selftest.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) else None


def staleness(result: dict, workdir: Workdir) -> str | None:
    """Why a stored result no longer describes this workdir, or None."""
    if result.get("trainer") != trainer_build(workdir):
        return "it tested another trainer build (setup ran since)"
    return None


def describe_gpu(result: dict) -> str:
    gpu = (result.get("environment") or {}).get("gpu")
    return gpu["name"] if gpu else "no GPU"


def resolve_qtype(qtype: str, workdir: Workdir, streams: bool = False) -> QtypeChoice:
    """`auto` -> the self-test's fastest passing qtype, else a fallback; any other qtype stays.
    `streams`: a memory plan may stream blocks, so only a streamable qtype will do."""
    if qtype != AUTO:
        return QtypeChoice(qtype)
    result, unusable = usable_result(workdir)
    if result is None:
        return fallback(unusable, streams)
    return qtype_from(result, streams)


def fallback(why: str, streams: bool) -> QtypeChoice:
    """The qtype where no 4-bit kernel passed: uint4, or int4_fused's reference path where blocks may stream."""
    if streams:
        return QtypeChoice(STREAMING_FALLBACK, {"int4_kernel": False},
                           f"qtype auto -> {STREAMING_FALLBACK} (plain-PyTorch path; the memory plan may stream blocks, "
                           f"which {FALLBACK_QTYPE} cannot): {why}; {REFERENCE_COST}")
    return QtypeChoice(FALLBACK_QTYPE, line=f"qtype auto -> {FALLBACK_QTYPE}: {why}")


def qtype_from(result: dict, streams: bool = False) -> QtypeChoice:
    """What `qtype: auto` becomes under a valid self-test result."""
    fastest = result.get("fastest") or {}
    if fastest.get("qtype") not in QTYPES.STREAMABLE:
        reason = fastest.get("reason") or "no 4-bit kernel passed"
        cost = "" if streams else f"; {FALLBACK_COST}"
        return fallback(f"{reason} ({tested_on(result)}){cost}; {HOW_TO_TEST}", streams)
    speed = f", block Linears {fastest['x_bf16']:.2f}x the bf16 time" if fastest.get("x_bf16") else ""
    return QtypeChoice(fastest["qtype"], dict(fastest.get("kernel") or {}),
                       f"qtype auto -> {fastest['qtype']} ({fastest.get('candidate')}): passed the "
                       f"{tested_on(result)}{speed}")


def card_vram_gib(workdir: Workdir) -> float | None:
    """The VRAM of the GPU the stored self-test ran on, or None when there is no usable result."""
    result, _ = usable_result(workdir)
    return ((result or {}).get("environment") or {}).get("gpu", {}).get("vram_gib") if result else None


def eight_bit_kernel(workdir: Workdir) -> tuple[dict, str]:
    """(model_kwargs, why) for a run of an 8-bit-activation qtype (int4_w4a8) whose preset leaves
    the kernel to `auto`: the self-test's candidate of such a qtype when it was the fastest, else
    FP8 where the self-test saw FP8 units, else int8 through Triton, which runs on every GPU."""
    result, unusable = usable_result(workdir)
    fastest = (result or {}).get("fastest") or {}
    if QTYPES.has_eight_bit_kernel(fastest.get("qtype")):
        return dict(fastest.get("kernel") or {}), f"the self-test's fastest ({tested_on(result)})"
    if result is not None and (result.get("environment") or {}).get("gpu"):
        fmt = "fp8" if result["environment"].get("fp8_units") else "int8"
        return {"w4a8_activations": fmt, "w4a8_gemm": "triton"}, f"the GPU's 8-bit units ({tested_on(result)})"
    return {"w4a8_activations": "int8", "w4a8_gemm": "triton"}, f"runs on every GPU; {unusable or HOW_TO_TEST}"


def resolve_config(config: dict, workdir: Workdir) -> list[str]:
    """`qtype: auto` and int4_w4a8's `auto` (or unset) kernel in every trainer process of a rendered
    config, in place; returns the lines `run` prints."""
    lines = []
    for process in config["config"]["process"]:
        model = process.get("model") or {}
        if model.get("model_kwargs") is None:
            model["model_kwargs"] = {}
        kwargs = model["model_kwargs"]
        if model.get("qtype") == AUTO:
            choice = resolve_qtype(AUTO, workdir, streams=streams_on(process, card_vram_gib(workdir)))
            model["qtype"] = choice.qtype
            kwargs.update({key: value for key, value in choice.kernel.items() if kwargs.get(key, AUTO) == AUTO})
            lines.append(choice.line)
        qtype = model.get("qtype")
        if QTYPES.has_eight_bit_kernel(qtype) and any(kwargs.get(key, AUTO) == AUTO for key in KERNEL_KEYS):
            kernel, why = eight_bit_kernel(workdir)
            kwargs.update({key: value for key, value in kernel.items() if kwargs.get(key, AUTO) == AUTO})
            lines.append(f"{qtype} kernel -> {kwargs.get('w4a8_activations')} {kwargs.get('w4a8_gemm')}: {why}")
    return lines


def usable_result(workdir: Workdir) -> tuple[dict | None, str | None]:
    """(the stored result, None), or (None, why it cannot decide anything: none yet, or stale)."""
    result = load_result(workdir)
    if result is None:
        return None, f"no self-test result in {workdir.root}; {HOW_TO_TEST}"
    stale = staleness(result, workdir)
    if stale:
        return None, f"{workdir.selftest.name} is stale ({stale}); {HOW_TO_TEST}"
    return result, None


def tested_on(result: dict) -> str:
    return f"self-test of {str(result.get('created', '?'))[:10]}, {describe_gpu(result)}"


def streaming_verdict(workdir: Workdir) -> tuple[str, str]:
    """(mode, why) for `stream_mode: auto`, from the stored self-test result."""
    result, unusable = usable_result(workdir)
    if result is None:
        return SERIALIZED, unusable
    return streaming_from(result)


def streaming_from(result: dict) -> tuple[str, str]:
    """(mode, why): overlapped only where the self-test ran the overlapped streaming on an NVIDIA
    GPU to completion within its deadline; serialized everywhere else. On AMD cards it stays
    serialized, and the self-test does not try it there: block swap with copies in flight during
    kernels deadlocked the HIP driver on Windows (wall 5), and overlapping would save little
    there (docs/amd.md, "Streaming on AMD cards")."""
    streaming = result.get("streaming") or {}
    if (result.get("environment") or {}).get("hip"):
        return SERIALIZED, f"overlapped streaming is not tried on AMD GPUs (wall 5, docs/amd.md) ({tested_on(result)})"
    if streaming.get("passed") and streaming.get("device") == "cuda":
        return OVERLAPPED, f"overlapped streaming completed in {streaming.get('seconds', 0):.0f} s ({tested_on(result)})"
    return SERIALIZED, f"{streaming.get('reason') or 'overlapped streaming was not tested on a GPU'} ({tested_on(result)})"


def resolve_stream_mode(config: dict, workdir: Workdir) -> str | None:
    """`stream_mode: auto` (or unset) of every process with `memory_plan: auto` -> serialized or
    overlapped, in place; returns the line `run` prints, or None when no process plans."""
    line = None
    for process in config["config"]["process"]:
        kwargs = (process.get("model") or {}).get("model_kwargs") or {}
        if kwargs.get("memory_plan") == AUTO and kwargs.get("stream_mode", AUTO) == AUTO:
            mode, why = streaming_verdict(workdir)
            kwargs["stream_mode"] = mode
            line = f"stream_mode auto -> {mode}: {why}"
    return line


def compile_verdict(workdir: Workdir) -> tuple[bool, str]:
    """(compile, why) for `compile_blocks: auto`, from the stored self-test result."""
    result, unusable = usable_result(workdir)
    if result is None:
        return False, unusable
    return compile_from(result)


def compile_from(result: dict) -> tuple[bool, str]:
    """(compile, why): the blocks are compiled only where the self-test compiled a small FLUX.2 on
    this GPU, matched the uncompiled model's loss and gradients, and was not slower with it."""
    check = result.get("compile") or {}
    if not check.get("passed"):
        return False, f"{check.get('reason') or 'compiling was not tested on a GPU'} ({tested_on(result)})"
    return True, (f"the compiled blocks matched and stepped {check['x_eager']:.2f}x the uncompiled time, "
                  f"{check.get('compile_s', 0):.0f} s to compile ({tested_on(result)})")


def resolve_compile_blocks(config: dict, workdir: Workdir) -> str | None:
    """`compile_blocks: auto` of every process -> true or false, in place; returns the line `run`
    prints: the choice, or a warning when a preset says true where the check did not pass; None
    when no process compiles or says auto."""
    line = None
    for process in config["config"]["process"]:
        kwargs = (process.get("model") or {}).get("model_kwargs") or {}
        if kwargs.get("compile_blocks") == AUTO:
            compiled, why = compile_verdict(workdir)
            kwargs["compile_blocks"] = compiled
            line = f"compile_blocks auto -> {str(compiled).lower()}: {why}"
        elif kwargs.get("compile_blocks") is True:
            compiled, why = compile_verdict(workdir)
            if not compiled:
                line = (f"warning: compile_blocks: true, but the self-test's compile check did not pass here ({why}); "
                        "a compile failure on the first step falls back to uncompiled blocks")
    return line


def blas_from(result: dict) -> tuple[str, str]:
    """(library, why) for `rocm_blas: auto`: the faster of hipBLAS and hipBLASLt where the self-test
    timed both on this ROCm GPU, else `default` (PyTorch's own pick; on NVIDIA and the CPU the
    setting changes nothing)."""
    check = result.get("blas") or {}
    if not check.get("ran"):
        return ROCM_BLAS_DEFAULT, f"{check.get('reason') or 'not timed by this self-test'} ({tested_on(result)})"
    return check.get("library") or ROCM_BLAS_DEFAULT, f"{check.get('reason')} ({tested_on(result)})"


def resolve_rocm_blas(config: dict, workdir: Workdir) -> str | None:
    """`rocm_blas: auto` (or unset) of every process -> hipblas, hipblaslt or default, in place;
    returns the line `run` prints where the self-test ran on a ROCm GPU (elsewhere it says nothing:
    the setting changes nothing there)."""
    line = None
    for process in config["config"]["process"]:
        kwargs = (process.get("model") or {}).get("model_kwargs")
        if kwargs is None or kwargs.get("rocm_blas", AUTO) != AUTO:
            continue
        result, unusable = usable_result(workdir)
        library, why = blas_from(result) if result is not None else (ROCM_BLAS_DEFAULT, unusable)
        kwargs["rocm_blas"] = library
        if result is not None and (result.get("environment") or {}).get("hip"):
            line = f"rocm_blas auto -> {library}: {why}"
    return line


def resolve_sampling(config: dict, workdir: Workdir, setting: str) -> str | None:
    """In-training sampling (wall 6) stays on only where the self-test's sampling check passed for
    this trainer build, or when the preset says `launcher: {sampling: force}`; otherwise it is
    switched off in the rendered config, in place. Returns the line `run` prints, or None when
    no process samples."""
    sampling = [p for p in config["config"]["process"] if not (p.get("train") or {}).get("disable_sampling", False)]
    if not sampling:
        return None
    if setting == "force":
        return "in-training sampling on: forced by the preset (launcher: {sampling: force})"
    result = load_result(workdir)
    check = (result or {}).get("sampling") or {}
    stale = staleness(result, workdir) if result is not None else None
    if result is None:
        why = f"no self-test result in {workdir.root}"
    elif stale:
        why = f"{workdir.selftest.name} is stale ({stale})"
    elif not check.get("passed"):
        why = f"the self-test's sampling check did not pass ({check.get('error') or 'not run'})"
    else:
        return (f"in-training sampling on: the self-test of {str(result.get('created', '?'))[:10]} sampled on "
                f"{describe_gpu(result)}")
    for process in sampling:
        process.setdefault("train", {})["disable_sampling"] = True
    return (f"in-training sampling off: {why}; `python -m launcher selftest` checks that sampling completes here, "
            "or set `launcher: {sampling: force}` in the preset")


def summary_line(report: dict | None) -> str:
    """One line for `doctor` and run.json readers."""
    if report is None:
        return "none yet: `python -m launcher selftest` tests the 4-bit kernels on this GPU"
    fastest = report.get("fastest") or {}
    gpu = (report.get("environment") or {}).get("gpu")
    where = gpu["name"] if gpu else "no GPU"
    verdict = (f"qtype auto -> {fastest['qtype']} ({fastest.get('candidate')})" if fastest.get("qtype")
               else f"qtype auto -> uint4 ({fastest.get('reason')})")
    return f"{str(report.get('created'))[:19]} on {where}: {verdict}"


def rocm_runtime(report: dict | None) -> dict:
    """What `doctor` shows of the self-test's ROCm runtime checks: the BLAS library `rocm_blas: auto`
    takes and the VAE-sized convolution's verdict, each in one line (None where not run)."""
    if report is None:
        return {"blas": None, "convolution": None, "convolution_failed": False}
    blas, conv = report.get("blas") or {}, report.get("convolution") or {}
    blas_line = (f"{blas.get('library')} ({blas.get('reason')})" if blas.get("ran")
                 else f"not timed ({blas['reason']})" if blas else None)
    conv_line = (None if not conv else f"not run ({conv.get('reason')})" if not conv.get("ran")
                 else f"pass ({conv.get('library')}, {conv.get('seconds')} s)" if conv.get("passed")
                 else f"FAIL ({conv.get('error')})")
    return {"blas": blas_line, "convolution": conv_line, "convolution_failed": conv.get("passed") is False}

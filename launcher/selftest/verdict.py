"""The self-test's result in the workdir, and what it decides: the qtype behind `qtype: auto` and
its kernel, the stream mode behind `model_kwargs: {stream_mode: auto}` of a memory plan, whether
`model_kwargs: {compile_blocks: auto}` compiles the transformer blocks, the ROCm BLAS library behind
`model_kwargs: {rocm_blas: auto}`, the attention kernels behind `sdpa_kernels: auto`, MIOpen's search
behind `miopen_find_mode: auto`, and in-training sampling.

`python -m launcher selftest` writes `<workdir>/selftest.json` (written by
`launcher.in_trainer.selftest.runner` under the trainer's interpreter, stamped here with the trainer
build it tested). `run` reads it once per launch into `Verdicts`, and its resolvers
(launcher/resolve.py) ask that object. A preset's `qtype: auto` becomes the fastest 4-bit qtype
that passed there, with the model_kwargs that pick its kernel; where nothing passed it becomes the
fork's own `uint4`, or, where a memory plan may stream blocks, `int4_fused` on its plain-PyTorch
path (uint4 cannot stream); `run` says in one line why. The qtype facts come from the trainer's own
table (flux2_contract/qtypes.py).
"""

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from flux2_contract import qtypes
from launcher.envs.workdir import Workdir, read_state
from launcher.user_files import load_json_state

FALLBACK_QTYPE = qtypes.FALLBACK
STREAMING_FALLBACK = qtypes.STREAMING_FALLBACK
HOW_TO_TEST = "`python -m launcher selftest` (a few minutes) tests the 4-bit kernels on this GPU"
FALLBACK_COST = "uint4 steps slower than int4_fused and bf16 (measured: docs/cards.md)"
REFERENCE_COST = "the plain-PyTorch path steps slower than int4_fused's Triton kernels (measured: docs/cards.md)"
"""What a fallback costs, said where the measured figures are: the doc generator reads them from bench/results."""
SERIALIZED, OVERLAPPED = "serialized", "overlapped"
ROCM_BLAS_DEFAULT = SDPA_DEFAULT = FIND_MODE_DEFAULT = "default"


@dataclass(frozen=True)
class QtypeChoice:
    qtype: str
    kernel: dict = field(default_factory=dict)
    """The model_kwargs that pick its kernel (flux2_contract/settings.py), written into the run's config."""
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
    """The stored self-test, or None where it is missing or damaged (a FIFO, a huge or deeply nested
    file included): `run`, `doctor` and `report` then go on as before any self-test."""
    return load_json_state(workdir.selftest) or None


def staleness(result: dict, workdir: Workdir) -> str | None:
    """Why a stored result no longer describes this workdir, or None."""
    if result.get("trainer") != trainer_build(workdir):
        return "it tested another trainer build (setup ran since)"
    return None


@dataclass(frozen=True)
class Verdicts:
    """The stored self-test report of one launch, read once: every `auto` `run` resolves, and the
    summary run.json keeps, come from this object, never from another read of the file."""

    report: dict | None
    """The report as stored (also a stale one), or None where there is none or it cannot be read."""
    why_not: str | None = None
    """Why the report decides nothing here (none yet, or stale), or None where it does."""

    @classmethod
    def read(cls, workdir: Workdir) -> "Verdicts":
        report = load_result(workdir)
        if report is None:
            return cls(None, f"no self-test result in {workdir.root}")
        stale = staleness(report, workdir)
        return cls(report, f"{workdir.selftest.name} is stale ({stale})" if stale else None)

    @property
    def result(self) -> dict | None:
        """The report where it describes this trainer build, else None."""
        return None if self.why_not else self.report

    @property
    def unusable(self) -> str | None:
        """Why nothing is decided from the report, with how to test; None where it decides."""
        return f"{self.why_not}; {HOW_TO_TEST}" if self.why_not else None

    @property
    def summary(self) -> str:
        return summary_line(self.report)

    @property
    def on_hip(self) -> bool:
        """Whether a usable report was made on a ROCm GPU."""
        return bool(((self.result or {}).get("environment") or {}).get("hip"))

    @property
    def card_vram_gib(self) -> float | None:
        """The VRAM of the GPU a usable report ran on, or None."""
        return (((self.result or {}).get("environment") or {}).get("gpu") or {}).get("vram_gib")

    def decide(self, from_result: Callable[[dict], tuple], default) -> tuple:
        """(value, why) of a setting one check of the report decides: the check's, under a usable
        report, else the default and why the report is unusable."""
        return from_result(self.result) if self.result is not None else (default, self.unusable)

    def qtype(self, streams: bool) -> QtypeChoice:
        """What `qtype: auto` becomes; `streams`: a memory plan may stream blocks, so only a
        streamable qtype will do."""
        return qtype_from(self.result, streams) if self.result is not None else fallback(self.unusable, streams)

    def w4a8_kernel(self) -> tuple[dict, str]:
        """(model_kwargs, why) for a run of an 8-bit-activation qtype (int4_w4a8) whose preset leaves
        the kernel to `auto`: the self-test's candidate of such a qtype when it was the fastest, else
        FP8 where the self-test saw FP8 units, else int8 through Triton, which runs on every GPU."""
        result = self.result
        fastest = (result or {}).get("fastest") or {}
        if qtypes.has_eight_bit_kernel(fastest.get("qtype")):
            return dict(fastest.get("kernel") or {}), f"the self-test's fastest ({tested_on(result)})"
        if result is not None and (result.get("environment") or {}).get("gpu"):
            fmt = "fp8" if result["environment"].get("fp8_units") else "int8"
            return {"w4a8_activations": fmt, "w4a8_gemm": "triton"}, f"the GPU's 8-bit units ({tested_on(result)})"
        return {"w4a8_activations": "int8", "w4a8_gemm": "triton"}, f"runs on every GPU; {self.unusable or HOW_TO_TEST}"

    def sampling(self) -> tuple[bool, str]:
        """(sampled, why): whether the self-test's sampling check passed for this trainer build."""
        check = (self.result or {}).get("sampling") or {}
        if self.why_not:
            return False, self.why_not
        if not check.get("passed"):
            return False, f"the self-test's sampling check did not pass ({check.get('error') or 'not run'})"
        return True, f"the self-test of {str(self.result.get('created', '?'))[:10]} sampled on {describe_gpu(self.result)}"


def describe_gpu(result: dict) -> str:
    gpu = (result.get("environment") or {}).get("gpu")
    return gpu["name"] if gpu else "no GPU"


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
    if fastest.get("qtype") not in qtypes.STREAMABLE:
        reason = fastest.get("reason") or "no 4-bit kernel passed"
        cost = "" if streams else f"; {FALLBACK_COST}"
        return fallback(f"{reason} ({tested_on(result)}){cost}; {HOW_TO_TEST}", streams)
    speed = f", block Linears {fastest['x_bf16']:.2f}x the bf16 time" if fastest.get("x_bf16") else ""
    return QtypeChoice(fastest["qtype"], dict(fastest.get("kernel") or {}),
                       f"qtype auto -> {fastest['qtype']} ({fastest.get('candidate')}): passed the "
                       f"{tested_on(result)}{speed}")


def tested_on(result: dict) -> str:
    return f"self-test of {str(result.get('created', '?'))[:10]}, {describe_gpu(result)}"


def streaming_from(result: dict) -> tuple[str, str]:
    """(mode, why) for `stream_mode: auto`: overlapped only where the self-test ran the overlapped
    streaming on an NVIDIA GPU to completion within its deadline; serialized everywhere else. On AMD
    cards it stays serialized, and the self-test does not try it there: block swap with copies in
    flight during kernels deadlocked the HIP driver on Windows (wall 5), and overlapping would save
    little there (docs/amd.md, "Streaming on AMD cards")."""
    streaming = result.get("streaming") or {}
    if (result.get("environment") or {}).get("hip"):
        return SERIALIZED, f"overlapped streaming is not tried on AMD GPUs (wall 5, docs/amd.md) ({tested_on(result)})"
    if streaming.get("passed") and streaming.get("device") == "cuda":
        return OVERLAPPED, f"overlapped streaming completed in {streaming.get('seconds', 0):.0f} s ({tested_on(result)})"
    return SERIALIZED, f"{streaming.get('reason') or 'overlapped streaming was not tested on a GPU'} ({tested_on(result)})"


def compile_from(result: dict) -> tuple[bool, str]:
    """(compile, why) for `compile_blocks: auto`: the blocks are compiled only where the self-test
    compiled a small FLUX.2 on this GPU, matched the uncompiled model's loss and gradients, and was
    not slower with it."""
    check = result.get("compile") or {}
    if not check.get("passed"):
        return False, f"{check.get('reason') or 'compiling was not tested on a GPU'} ({tested_on(result)})"
    return True, (f"the compiled blocks matched and stepped {check['x_eager']:.2f}x the uncompiled time, "
                  f"{check.get('compile_s', 0):.0f} s to compile ({tested_on(result)})")


def blas_from(result: dict) -> tuple[str, str]:
    """(library, why) for `rocm_blas: auto`: the faster of hipBLAS and hipBLASLt where the self-test
    timed both on this ROCm GPU, hipBLAS untimed where hipBLASLt reset GPUs of its architecture
    (blas.RESETS), else `default` (PyTorch's own pick; on NVIDIA and the CPU the setting changes
    nothing)."""
    check = result.get("blas") or {}
    why = check.get("reason") or "not timed by this self-test"
    return check.get("library") or ROCM_BLAS_DEFAULT, f"{why} ({tested_on(result)})"


def attention_from(result: dict) -> tuple[str, str]:
    """(kernels, why) for `sdpa_kernels: auto`: what the self-test's attention check found on this
    GPU (launcher/in_trainer/selftest/attention.py), else `default`."""
    check = result.get("attention") or {}
    why = check.get("reason") or "not checked by this self-test"
    return check.get("kernels") or SDPA_DEFAULT, f"{why} ({tested_on(result)})"


def find_mode_from(result: dict) -> tuple[str, str]:
    """(mode, why) for `miopen_find_mode: auto`: `fast` where the self-test's first MIOpen
    convolution call was slow (launcher/in_trainer/selftest/convolution.py), else `default`."""
    check = result.get("convolution") or {}
    why = check.get("reason") or check.get("error") or "not timed by this self-test"
    return check.get("find_mode") or FIND_MODE_DEFAULT, f"{why} ({tested_on(result)})"


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
                 else f"pass ({conv.get('library')}, first call {conv.get('first_s')} s)" if conv.get("passed")
                 else f"FAIL ({conv.get('error')})")
    return {"blas": blas_line, "convolution": conv_line, "convolution_failed": conv.get("passed") is False}

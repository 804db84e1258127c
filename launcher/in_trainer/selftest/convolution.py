"""The self-test's convolution check: one VAE-sized convolution on the GPU through the vendor
library (MIOpen on ROCm, cuDNN on NVIDIA), against the same convolution with that library
switched off, with the time of its first call and of a second.

On Windows 11 with an RX 7900 XTX, MIOpen's run-time kernel compilation can fail for missing
headers (`HIPRTC_ERROR_COMPILATION`, `'type_traits' file not found`, then
`miopenStatusUnknownError`: https://github.com/ROCm/ROCm/issues/5941), and the first launch encodes
every training image with the VAE's convolutions. The trainer survives that
(toolkit/vae_fallback.py retries the encode without MIOpen); this check tells the user before
the first launch, in the report and in `doctor`.

A first call can also be slow without failing: MIOpen searches (and compiles) a kernel for each
new convolution shape, and with MIOpen 3.5.2 that search skipped the naive solvers, so a first
VAE decode took 37 minutes instead of 1 (TheRock issue #2591). Where the first call is slower
than the second by more than SLOW_FIRST_CALL_S, `miopen_find_mode: auto` becomes `fast` and
`run` sets MIOPEN_FIND_MODE=FAST for the trainer. Stdlib-only at module level.
"""

import time

CHANNELS, SIDE = 128, 512
"""The FLUX.2 VAE encoder's first and widest stage: 128 channels at the image's full size."""
TOLERANCE = 2e-2
"""Largest relative difference from the convolution without the vendor library: both are bf16
convolutions with fp32 sums in other orders; a broken kernel is far off."""
ENCODER_SHAPES = 13
"""Distinct convolution shapes of one VAE encode at one image size: conv_in, per level of the
(1, 2, 4, 4) x 128-channel encoder its ResNet convolutions (one shape at level 0 and 3, three
where the width doubles: conv1, conv2 and the 1x1 shortcut) and a downsample at levels 0-2, then
conv_out: 1 + 1 + 3 + 3 + 1 + 3 + 1 = 13. Each new shape pays its first-call search once per size."""
FIRST_ENCODE_BUDGET_S = 60.0
"""What the first launch may spend searching kernels for the VAE encode of one image size."""
SLOW_FIRST_CALL_S = FIRST_ENCODE_BUDGET_S / ENCODER_SHAPES
"""A first call slower than the second by more than this (4.6 s) would cost the first encode more
than FIRST_ENCODE_BUDGET_S: 13 shapes x 4.6 s = 60 s."""
FAST, DEFAULT = "fast", "default"


def find_mode(first_s: float, second_s: float) -> dict:
    """`miopen_find_mode` from the two calls' seconds, with the reason in words."""
    search = first_s - second_s
    if search > SLOW_FIRST_CALL_S:
        return {"find_mode": FAST, "reason": f"the first call took {first_s:.1f} s, the second {second_s:.2f} s: "
                                             f"{ENCODER_SHAPES} encoder shapes would search for ~{search * ENCODER_SHAPES:.0f} s "
                                             f"(over {FIRST_ENCODE_BUDGET_S:.0f} s)"}
    return {"find_mode": DEFAULT, "reason": f"the first call took {first_s:.1f} s, the second {second_s:.2f} s "
                                            f"(a search of at most {SLOW_FIRST_CALL_S:.1f} s a shape is fine)"}


def timed_call(torch, fn, clock=time.perf_counter) -> tuple[object, float]:
    """(fn's result, seconds to the GPU's end of it)."""
    began = clock()
    result = fn()
    torch.cuda.synchronize()
    return result, clock() - began


def check(torch, device, clock=time.perf_counter) -> dict:
    """{"passed", "first_s", "second_s", "find_mode", ...}: the convolution ran through the vendor
    library and matched; on the CPU it is not run. `find_mode` is decided on ROCm only."""
    if device is None or not torch.cuda.is_available():
        return {"ran": False, "passed": None, "reason": "no GPU: the VAE's convolutions run on the CPU"}
    hip = bool(getattr(torch.version, "hip", None))
    library = "MIOpen" if hip else "cuDNN"
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, CHANNELS, SIDE, SIDE, device=device, generator=g, dtype=torch.bfloat16)
    weight = torch.randn(CHANNELS, CHANNELS, 3, 3, device=device, generator=g, dtype=torch.bfloat16) * 0.03
    convolve = lambda: torch.nn.functional.conv2d(x, weight, padding=1).float()  # noqa: E731
    try:
        with torch.backends.cudnn.flags(enabled=True):
            got, first = timed_call(torch, convolve, clock)
            _, second = timed_call(torch, convolve, clock)
    except RuntimeError as error:  # the failure the trainer's VAE encode falls back from
        return {"ran": True, "passed": False, "library": library, "error": f"{type(error).__name__}: {error}"[:800]}
    with torch.backends.cudnn.flags(enabled=False):
        want = convolve()
    difference = float((got - want).norm() / want.norm().clamp_min(1e-30))
    passed = difference <= TOLERANCE
    mode = find_mode(first, second) if hip else {"find_mode": DEFAULT, "reason": "cuDNN: no MIOpen search"}
    return {"ran": True, "passed": passed, "library": library, "first_s": round(first, 2), "second_s": round(second, 3),
            "max_relative_difference": difference, "tolerance": TOLERANCE, **mode,
            **({} if passed else {"error": f"differs from the convolution without {library} by {difference:.1e}"})}

"""The self-test's convolution check: one VAE-sized convolution on the GPU through the vendor
library (MIOpen on ROCm, cuDNN on NVIDIA), against the same convolution with that library
switched off.

On Windows 11 with an RX 7900 XTX, MIOpen's run-time kernel compilation can fail for missing
headers (`HIPRTC_ERROR_COMPILATION`, `'type_traits' file not found`, then
`miopenStatusUnknownError`: https://github.com/ROCm/ROCm/issues/5941), and the first launch encodes
every training image with the VAE's convolutions. The trainer survives that
(toolkit/vae_fallback.py retries the encode without MIOpen); this check tells the user before
the first launch, in the report and in `doctor`. Stdlib-only at module level.
"""

import time

CHANNELS, SIDE = 128, 512
"""The FLUX.2 VAE encoder's first and widest stage: 128 channels at the image's full size."""
TOLERANCE = 2e-2
"""Largest relative difference from the convolution without the vendor library: both are bf16
convolutions with fp32 sums in other orders; a broken kernel is far off."""


def check(torch, device) -> dict:
    """{"passed", "seconds", ...}: the convolution ran through the vendor library and matched;
    on the CPU, or with no vendor library, it is not run."""
    if device is None or not torch.cuda.is_available():
        return {"ran": False, "passed": None, "reason": "no GPU: the VAE's convolutions run on the CPU"}
    library = "MIOpen" if getattr(torch.version, "hip", None) else "cuDNN"
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, CHANNELS, SIDE, SIDE, device=device, generator=g, dtype=torch.bfloat16)
    weight = torch.randn(CHANNELS, CHANNELS, 3, 3, device=device, generator=g, dtype=torch.bfloat16) * 0.03
    began = time.perf_counter()
    try:
        with torch.backends.cudnn.flags(enabled=True):
            got = torch.nn.functional.conv2d(x, weight, padding=1).float()
            torch.cuda.synchronize()
    except RuntimeError as error:  # the failure the trainer's VAE encode falls back from
        return {"ran": True, "passed": False, "library": library, "error": f"{type(error).__name__}: {error}"[:800]}
    seconds = time.perf_counter() - began
    with torch.backends.cudnn.flags(enabled=False):
        want = torch.nn.functional.conv2d(x, weight, padding=1).float()
    difference = float((got - want).norm() / want.norm().clamp_min(1e-30))
    passed = difference <= TOLERANCE
    return {"ran": True, "passed": passed, "library": library, "seconds": round(seconds, 2),
            "max_relative_difference": difference, "tolerance": TOLERANCE,
            **({} if passed else {"error": f"differs from the convolution without {library} by {difference:.1e}"})}

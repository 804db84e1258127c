"""The VAE encode survives a MIOpen failure.

On Windows 11 with an RX 7900 XTX, MIOpen's run-time kernel compilation can fail for missing
headers (`HIPRTC_ERROR_COMPILATION`, then `miopenStatusUnknownError`:
https://github.com/ROCm/ROCm/issues/5941), and the first launch encodes every training image with
the VAE's convolutions. An encode that fails with a MIOpen error is retried with
`torch.backends.cudnn.enabled = False`, which on ROCm sends the convolutions to PyTorch's own
kernels instead of MIOpen; if that fails too, on the CPU. The first fallback that works is said
in one line and kept for the rest of the run. Any other error is raised as it was.
"""

from __future__ import annotations

import torch

NO_VENDOR_LIBRARY, CPU = "without MIOpen", "on the CPU"
_ATTRIBUTE = "_flux2_24gb_encode_fallback"


def is_miopen_error(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and "miopen" in str(error).lower()


def _encode_without_vendor_library(vae, images):
    with torch.backends.cudnn.flags(enabled=False):
        return vae.encode(images)


def _encode_on_cpu(vae, images):
    """The VAE moved to the CPU for this encode and back; the latents on the images' device."""
    device = next(vae.parameters()).device
    try:
        vae.to("cpu")
        return vae.encode(images.to("cpu")).to(images.device)
    finally:
        vae.to(device)


FALLBACKS = {NO_VENDOR_LIBRARY: _encode_without_vendor_library, CPU: _encode_on_cpu}


def encode(vae, images):
    """vae.encode(images), or the same through the first fallback that works after a MIOpen error."""
    kept = getattr(vae, _ATTRIBUTE, None)
    if kept is not None:
        return FALLBACKS[kept](vae, images)
    try:
        return vae.encode(images)
    except RuntimeError as error:
        if not is_miopen_error(error):
            raise
        first_error = error
    for name, fallback in FALLBACKS.items():
        try:
            latents = fallback(vae, images)
        except RuntimeError as error:  # the next fallback; the CPU's error is the last word
            if name == CPU:
                raise error from first_error
            continue
        setattr(vae, _ATTRIBUTE, name)
        print(f"VAE encode: MIOpen failed ({str(first_error).splitlines()[0][:160]}); encoding {name} from now on "
              "(see https://github.com/ROCm/ROCm/issues/5941)", flush=True)
        return latents

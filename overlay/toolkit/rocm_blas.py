"""The BLAS library of a ROCm GPU's bf16 matmuls, as the run's config names it (`rocm_blas`).

PyTorch's own pick for RDNA3 has flipped between hipBLAS and hipBLASLt from release to release
(https://github.com/ROCm/pytorch/pull/2168, https://github.com/ROCm/pytorch/pull/3207), so
`python -m launcher selftest` times both at the 4-bit path's GEMMs on the user's card and `run`
writes the faster into model_kwargs. The FLUX.2 model sets it when it starts loading, before its
first matmul on the GPU. On NVIDIA and on the CPU it does nothing.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from flux2_contract.settings import read

DEFAULT = "default"


def apply(model_kwargs: Mapping[str, Any], torch_module=None) -> Optional[str]:
    """Set the configured library on a ROCm build; returns the line printed, or None where nothing
    changed (NVIDIA, the CPU, or `default`). A library PyTorch will not use on this GPU (it
    falls back with a warning of its own) is said so in the line."""
    library = read(dict(model_kwargs), "rocm_blas")
    torch = torch_module
    if torch is None:
        import torch
    if library == DEFAULT or not getattr(torch.version, "hip", None):
        return None
    now = str(torch.backends.cuda.preferred_blas_library(library)).lower()
    took = now.endswith("cublaslt") == (library == "hipblaslt")
    line = (f"rocm_blas: the bf16 matmuls go through {library} (the self-test's pick)" if took
            else f"rocm_blas: {library} asked, but PyTorch keeps {now} on this GPU")
    print(line, flush=True)
    return line

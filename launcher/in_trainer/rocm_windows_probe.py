"""Run by setup inside the trainer venv on Windows ROCm: the GPUs in HIP's order, and one Triton kernel.

`python -m launcher.in_trainer.rocm_windows_probe devices|compile`, one JSON object on stdout.
HIP's own order is what HIP_VISIBLE_DEVICES indexes, so the device list comes from torch here and
not from Windows' adapter list (another order, and its memory field stops at 4 GiB). Only device
properties are read: no context is created on a GPU that may be an integrated one.

torch is imported before triton in both: with TheRock's ROCm, triton first loads the driver's
amdhip64 and torch's own HIP DLLs then fail to load (triton-lang/triton-windows#35).
"""

import json
import sys
import tempfile
from pathlib import Path

KERNEL_SOURCE = '''
import triton
import triton.language as tl


@triton.jit
def add_one(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1.0, mask=mask)
'''


def devices() -> dict:
    import torch

    found = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        found.append({"index": index, "name": props.name, "arch": getattr(props, "gcnArchName", ""),
                      "total_gib": round(props.total_memory / 2**30, 1)})
    return {"hip": getattr(torch.version, "hip", None), "gpus": found}


def compile_one() -> dict:
    """Compile and run a trivial kernel: the launcher stub (hip_utils.c, built by clang-cl) and the
    kernel itself both have to build for this to pass. Triton's `jit` reads the kernel's source
    file, so the kernel is written to a file and imported from there."""
    import importlib.util

    import torch

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "flux2_24gb_triton_probe.py"
        path.write_text(KERNEL_SOURCE, encoding="utf-8")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        x = torch.zeros(16, device="cuda")
        module.add_one[(1,)](x, 16, BLOCK=16)
        torch.cuda.synchronize()
        total = float(x.sum().item())
    if total != 16.0:
        raise RuntimeError(f"the kernel ran but wrote {total}, not 16.0")
    import triton

    return {"triton": triton.__version__, "device": torch.cuda.get_device_name(0)}


if __name__ == "__main__":
    print(json.dumps(devices() if sys.argv[1:] == ["devices"] else compile_one()), flush=True)

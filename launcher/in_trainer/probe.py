"""What torch sees, read inside a process of the trainer's venv: `python -m launcher.in_trainer.probe`.

Run in-process because a second process cannot be trusted for VRAM on ROCm/Windows
(wall 10: it reports ~0 GB in use while the trainer holds 20 GB). Prints one JSON object.
"""

import json
import platform


def probe() -> dict:
    info: dict = {"python": platform.python_version()}
    try:
        import torch
    except ImportError as error:
        return {**info, "torch": None, "error": f"torch does not import: {error}"}
    info.update(
        torch=torch.__version__,
        hip=getattr(torch.version, "hip", None),
        cuda=torch.version.cuda,
        gpu_available=torch.cuda.is_available(),
        gpus=[],
    )
    for index in range(torch.cuda.device_count() if info["gpu_available"] else 0):
        props = torch.cuda.get_device_properties(index)
        free, total = torch.cuda.mem_get_info(index)
        info["gpus"].append({
            "name": props.name,
            "arch": getattr(props, "gcnArchName", None) or f"sm_{props.major}{props.minor}",
            "vram_total_gib": round(total / 2**30, 2),
            "vram_free_gib": round(free / 2**30, 2),
        })
    return info


if __name__ == "__main__":
    print(json.dumps(probe()))

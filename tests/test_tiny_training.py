"""End to end: `python -m launcher run` trains the embedded tiny FLUX.2 for 2 steps.

This is the smoke test of the whole chain (setup's patched trainer and venv, preset rendering,
tiny assets, the trainer's load/quantize/cache/train/save) on whatever device the trainer picks:
the CPU in CI, the GPU on a GPU box. The LoRA file is read with the standard library so this
test does not depend on the interpreter running pytest having safetensors.
"""

import json
import math
import re
import shutil
import struct
from pathlib import Path

import pytest
from tiny_run import RUN_NAME, run_tiny

pytestmark = pytest.mark.trainer

LOSS = re.compile(rb"loss: ([^\s,\]]+)")
BLOCK_LORA = re.compile(r"^diffusion_model\.(double_blocks|single_blocks)\.\d+\..+\.lora_([AB])\.weight$")
BF16_ZERO_MASK = 0x7FFF  # bf16/fp16 values are zero when all bits but the sign are zero


def safetensors_tensors(path: Path) -> dict[str, tuple[str, bytes]]:
    """{name: (dtype, raw bytes)} from a .safetensors file: a u64 header size, a JSON header, data."""
    blob = path.read_bytes()
    (header_size,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + header_size])
    data = blob[8 + header_size :]
    return {
        name: (entry["dtype"], data[entry["data_offsets"][0] : entry["data_offsets"][1]])
        for name, entry in header.items()
        if name != "__metadata__"
    }


def is_nonzero_half(dtype: str, raw: bytes) -> bool:
    assert dtype in ("BF16", "F16"), f"unexpected LoRA dtype {dtype}"
    return any(value & BF16_ZERO_MASK for (value,) in struct.iter_unpack("<H", raw))


@pytest.fixture(scope="module")
def tiny_run(target_workdir):
    """Run the tiny preset once per target in a fresh run folder; the built tiny assets are reused.

    The folder is removed first because the trainer resumes from an existing run folder, and a
    finished 2-step run would resume at step 2 and train nothing.
    """
    workdir = target_workdir.workdir
    shutil.rmtree(workdir.runs / RUN_NAME, ignore_errors=True)
    return workdir.runs / RUN_NAME, run_tiny(workdir.root)


def test_run_exits_zero(tiny_run):
    run_dir, result = tiny_run
    assert result.returncode == 0, result.stdout[-4000:]


def test_log_has_finite_losses(tiny_run):
    run_dir, _ = tiny_run
    losses = [float(value) for value in LOSS.findall((run_dir / "train.log").read_bytes())]
    assert losses, "no loss in train.log"
    assert all(math.isfinite(loss) for loss in losses), losses


def test_lora_trains_transformer_blocks(tiny_run):
    run_dir, _ = tiny_run
    lora = run_dir / RUN_NAME / f"{RUN_NAME}.safetensors"
    assert lora.is_file(), f"no LoRA at {lora}"
    tensors = safetensors_tensors(lora)
    block_keys = {name: BLOCK_LORA.match(name) for name in tensors}
    a_keys = [name for name, match in block_keys.items() if match and match.group(2) == "A"]
    b_keys = [name for name, match in block_keys.items() if match and match.group(2) == "B"]
    assert a_keys and len(a_keys) == len(b_keys), sorted(tensors)
    assert {BLOCK_LORA.match(name).group(1) for name in b_keys} == {"double_blocks", "single_blocks"}
    zero = [name for name in b_keys if not is_nonzero_half(*tensors[name])]
    assert not zero, f"lora_B still zero after 2 steps: {zero}"


"""The omnigen2 patch: the built-in extensions import on a machine without a GPU.

omnigen2's Triton layer norm built its autotune configs from the current CUDA device at import,
so importing the trainer's extensions (run.py imports them all) failed wherever no GPU is
visible: CI, CPU smoke tests. The module's import-time code is run in a fresh interpreter with
every GPU hidden; without the patch it raises torch's "no GPU" error.
"""

import os
import subprocess
import sys

LAYER_NORM = "extensions_built_in/diffusion_models/omnigen2/src/ops/triton/layer_norm.py"
PROBE = """
import importlib.util, sys, torch
assert not torch.cuda.is_available()
spec = importlib.util.spec_from_file_location("omnigen2_layer_norm", sys.argv[1])
spec.loader.exec_module(importlib.util.module_from_spec(spec))
print("imported")
"""


def test_omnigen2_layer_norm_imports_with_no_gpu_visible(trainer_checkout):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-c", PROBE, str(trainer_checkout / LAYER_NORM)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "imported"

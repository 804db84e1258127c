"""Fixtures that load single modules of the patched trainer by path.

This suite runs inside the trainer's venv (torch, safetensors, torchao, ...), started by
tests/test_trainer_patches.py, which names the workdir in LAUNCHER_TEST_WORKDIR. Loading
modules by path keeps these tests independent of the trainer's import-time side effects.
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def trainer_checkout() -> Path:
    root = os.environ.get("LAUNCHER_TEST_WORKDIR")
    if not root:
        pytest.skip("run through tests/test_trainer_patches.py, which sets LAUNCHER_TEST_WORKDIR")
    return Path(root) / "trainer"


def load_by_path(checkout: Path, relative: str, name: str):
    spec = importlib.util.spec_from_file_location(name, Path(checkout) / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up here
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def streamed_safetensors(trainer_checkout):
    return load_by_path(
        trainer_checkout, "toolkit/streamed_safetensors.py", "patched_streamed_safetensors"
    )


@pytest.fixture(scope="session")
def flux2_src(trainer_checkout):
    """The fork's Flux2 model definition (torch + einops only)."""
    return load_by_path(
        trainer_checkout,
        "extensions_built_in/diffusion_models/flux2/src/model.py",
        "patched_flux2_src_model",
    )


@pytest.fixture(scope="session")
def trainer_on_path(trainer_checkout):
    """Put the checkout first on sys.path for tests that import toolkit packages."""
    path = str(trainer_checkout)
    sys.path.insert(0, path)
    yield Path(path)
    sys.path.remove(path)

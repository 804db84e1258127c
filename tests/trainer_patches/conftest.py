"""Fixtures that load single modules of the patched trainer by path.

This suite runs inside the trainer's venv (torch, safetensors, torchao, ...), started by
tests/test_trainer_patches.py once per target, which names the workdir in LAUNCHER_TEST_WORKDIR
and the target's series file in LAUNCHER_TEST_SERIES. Loading modules by path keeps these tests
independent of the trainer's import-time side effects.

Markers: `patch("<part of a patch file name>")` for a test of a patch that not every target
carries (deselected where the series lacks it); `gpu` for a test that needs a GPU.
"""

import importlib.util
import os
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))  # tests/: the shared tiny_run helper

DESELECTED_FOR_THE_SERIES = pytest.StashKey[list]()


def carried_patches(series: Path) -> list[str]:
    """The patch file names a series file lists (comments and blank lines left out)."""
    lines = series.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def pytest_collection_modifyitems(config, items):
    """Deselect the tests of patches that this target's series does not carry, and say which."""
    series = os.environ.get("LAUNCHER_TEST_SERIES")
    if not series:
        return
    carried = carried_patches(Path(series))
    missing = [item for item in items
               if (mark := item.get_closest_marker("patch")) and not any(mark.args[0] in name for name in carried)]
    config.stash[DESELECTED_FOR_THE_SERIES] = [item.nodeid for item in missing]
    if missing:
        config.hook.pytest_deselected(items=missing)
        items[:] = [item for item in items if item not in missing]


def pytest_terminal_summary(terminalreporter, config):
    names = config.stash.get(DESELECTED_FOR_THE_SERIES, [])
    if names:
        terminalreporter.write_line(f"deselected: {len(names)} test(s) of patches {os.environ['LAUNCHER_TEST_SERIES']} does not list")


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") and not torch.cuda.is_available():
        pytest.skip("needs a GPU (torch.cuda.is_available() is False)")


def checkout_from_env():
    """The trainer checkout named by LAUNCHER_TEST_WORKDIR, or None."""
    root = os.environ.get("LAUNCHER_TEST_WORKDIR")
    return Path(root) / "trainer" if root else None


@pytest.fixture(scope="session")
def trainer_checkout() -> Path:
    checkout = checkout_from_env()
    if checkout is None:
        pytest.skip("run through tests/test_trainer_patches.py, which sets LAUNCHER_TEST_WORKDIR")
    return checkout


# {file: number of tests deselected for want of it}, for the summary
OTHER_TARGET = pytest.StashKey[Counter]()


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "trainer_has(path): runs only where the trainer checkout has this file (a module that only "
        "one target has); deselected, with the reason printed, elsewhere",
    )


def pytest_collection_modifyitems(config, items):
    """Deselect (rather than skip) the tests of another target's modules: the bridge, which
    runs this suite on one target, counts any skip as a suite that did not really run."""
    checkout = checkout_from_env()
    if checkout is None:
        return
    keep, other_target = [], []
    for item in items:
        mark = item.get_closest_marker("trainer_has")
        (other_target if mark and not (checkout / mark.args[0]).is_file() else keep).append(item)
    if other_target:
        config.hook.pytest_deselected(items=other_target)
        items[:] = keep
        config.stash[OTHER_TARGET] = Counter(i.get_closest_marker("trainer_has").args[0] for i in other_target)


def pytest_terminal_summary(terminalreporter, config):
    for path, count in sorted(config.stash.get(OTHER_TARGET, {}).items()):
        terminalreporter.write_line(f"deselected {count} tests that need {path}: this trainer has none")


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


@pytest.fixture(scope="session")
def tiny_text_encoder(trainer_checkout, tmp_path_factory) -> Path:
    """The embedded tiny FLUX.2's Mistral3 folder, built once per session."""
    from launcher.in_trainer import tiny_assets
    from launcher.runs import tiny

    out = tmp_path_factory.mktemp("tiny-assets")
    tiny_assets.build(trainer_checkout, out, seed=0)
    return Path(tiny.read_manifest(out, seed=0)["model_kwargs"]["text_encoder_path"])


def launcher_python() -> str:
    """The launcher's own interpreter (GitPython and friends live there, not in the trainer venv);
    the bridge, tests/test_trainer_patches.py, passes it in LAUNCHER_PYTHON."""
    return os.environ.get("LAUNCHER_PYTHON", sys.executable)


def plain_linears(module) -> list[str]:
    """Names of the Linears under `module` whose weight is a plain (not quantized) tensor."""
    return [
        name
        for name, m in module.named_modules()
        if isinstance(m, torch.nn.Linear) and type(m.weight) in (torch.Tensor, torch.nn.Parameter)
    ]


def loader_model(flux2_module, params, quantize=True, qtype="uint4", **model_kwargs):
    """A Flux2Model without running its constructor: just what the transformer loaders read."""
    model = flux2_module.Flux2Model.__new__(flux2_module.Flux2Model)
    model.torch_dtype = torch.bfloat16
    model.device_torch = torch.device("cpu")
    model.quantize_device = torch.device("cpu")
    model._status_update_hooks = []
    model.model_config = SimpleNamespace(
        quantize=quantize, qtype=qtype, accuracy_recovery_adapter=None, low_vram=False,
        model_kwargs=dict(model_kwargs, flux2_params=params),
    )
    return model


class StopAtTextEncoder(Exception):
    """Raised where load_model reaches the text encoder: the transformer is complete by then."""


@pytest.fixture
def load_transformer(monkeypatch):
    """load(flux2_module, model_config, training_folder) -> the transformer that the real
    Flux2Model.load_model built (from the checkpoint or the cache), stopped before the text encoder."""
    seen = []

    class StopTE:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            # load_model's local; upstream loads the text encoder in a method of its own
            frame = sys._getframe(1)
            while "transformer" not in frame.f_locals:
                frame = frame.f_back
            seen.append(frame.f_locals["transformer"])
            raise StopAtTextEncoder

    def load(flux2_module, model_config, training_folder):
        monkeypatch.setattr(flux2_module, "Mistral3ForConditionalGeneration", StopTE)
        base = flux2_module.Flux2Model(device="cpu", model_config=model_config, dtype="bf16")
        base.training_folder = str(training_folder)
        with pytest.raises(StopAtTextEncoder):
            base.load_model()
        return seen.pop()

    return load

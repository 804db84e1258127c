"""Fixtures that load single modules of the patched trainer by path.

This suite runs inside the trainer's venv (torch, safetensors, torchao, ...), started by
tests/test_trainer_patches.py once per target, which names the workdir in LAUNCHER_TEST_WORKDIR
and the target's series file in LAUNCHER_TEST_SERIES. Loading modules by path keeps these tests
independent of the trainer's import-time side effects.

Markers (pytest.ini): `patch("<part of a patch file name>")` for a test of a patch that not
every target carries (deselected where the series lacks it); `trainer_has(path)` for a test of a
module only one target has (deselected elsewhere); `first_target` for a test of the overlay alone,
the same files on every target (run in the first target's suite only); `gpu` for a test that
needs a GPU.
"""

import importlib.util
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))  # tests/: the shared tiny_run helper
import hypothesis_profile  # noqa: E402, F401  (seeds every Hypothesis test)

DESELECTED_ON_THIS_TARGET = pytest.StashKey[dict]()


ALLOCATOR_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": str(2**20), "MALLOC_TRIM_THRESHOLD_": str(2**20)}
"""For child processes whose peak host RSS a test compares: one malloc arena and a fixed mmap
threshold, so buffers of 1 MiB and more are mapped and returned one by one and the peak follows
what is alive, not the allocation order (test_load_host_memory.py has the measured spread)."""

def carried_patches(series: Path) -> list[str]:
    """The patch file names a series file lists (comments and blank lines left out)."""
    lines = series.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def is_first_target(series: str | None) -> bool:
    """Whether the series under test is the first target's of upstream.lock (or none is named)."""
    from launcher.patching.lock import DEFAULT_LOCK, load_targets

    return series is None or Path(series).resolve() == Path(load_targets(DEFAULT_LOCK)[0].series).resolve()


def why_not_on_this_target(item, checkout: Path, carried: list[str] | None, first: bool) -> str | None:
    """Why a test does not apply to the target under test, or None when it does."""
    if item.get_closest_marker("first_target") and not first:
        return "it tests the overlay alone, which the first target's suite runs"
    if item.get_closest_marker("user_stack") and not os.environ.get("LAUNCHER_TEST_USER_STACK"):
        return "it checks the user-stack venv (tests/user_stack.py)"
    patch = item.get_closest_marker("patch")
    if patch and carried is not None and not any(patch.args[0] in name for name in carried):
        return f"its patch ({patch.args[0]}) is not in this target's series"
    needs = item.get_closest_marker("trainer_has")
    if needs and not (checkout / needs.args[0]).is_file():
        return f"it needs {needs.args[0]}, which this trainer does not have"
    return None


def pytest_collection_modifyitems(config, items):
    """Deselect (rather than skip: the bridge counts a skip as a suite that did not really run)
    the tests that do not apply to this target, and say why in the summary."""
    checkout = checkout_from_env()
    if checkout is None:
        return
    series = os.environ.get("LAUNCHER_TEST_SERIES")
    carried = carried_patches(Path(series)) if series else None
    first = is_first_target(series)
    reasons = {item.nodeid: why for item in items if (why := why_not_on_this_target(item, checkout, carried, first))}
    config.stash[DESELECTED_ON_THIS_TARGET] = reasons
    if reasons:
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid in reasons])
        items[:] = [item for item in items if item.nodeid not in reasons]


def pytest_terminal_summary(terminalreporter, config):
    reasons = config.stash.get(DESELECTED_ON_THIS_TARGET, {})
    for why in sorted(set(reasons.values())):
        count = sum(1 for value in reasons.values() if value == why)
        terminalreporter.write_line(f"deselected on this target: {count} test(s), because {why}")


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


def load_by_path(checkout: Path, relative: str, name: str):
    spec = importlib.util.spec_from_file_location(name, Path(checkout) / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up here
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def streamed_safetensors(trainer_on_path):
    return importlib.import_module("toolkit.streamed_safetensors")


@pytest.fixture(scope="session")
def safetensors_header(trainer_on_path):
    return importlib.import_module("flux2_contract.safetensors_header")


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
    """The embedded tiny FLUX.2's Mistral3 folder, built once per test run."""
    from launcher.in_trainer import tiny_assets
    from launcher.runs import tiny

    out = tmp_path_factory.mktemp("tiny-assets")
    tiny_assets.build(trainer_checkout, out, seed=0)
    return Path(tiny.read_manifest(out, seed=0)["model_kwargs"]["text_encoder_path"])


def mistral_output_layers(pipeline) -> tuple:
    """The Mistral encoder layers FLUX.2 stacks; upstream main names the list for its encoder
    (OUTPUT_LAYERS_MISTRAL: FLUX.2 klein's Qwen encoder has its own)."""
    return tuple(getattr(pipeline, "OUTPUT_LAYERS", None) or pipeline.OUTPUT_LAYERS_MISTRAL)


def launcher_python() -> str:
    """The launcher's own interpreter (GitPython and friends live there, not in the trainer venv);
    the bridge, tests/test_trainer_patches.py, passes it in LAUNCHER_PYTHON."""
    return os.environ.get("LAUNCHER_PYTHON", sys.executable)


def launch_env(caches: Path) -> dict:
    """The environment of a test's `python -m launcher run` (the launcher importable from the
    repository) with quantized and text caches of its own under `caches`: the workdir's caches
    belong to the launcher's trainer tests, which run beside this suite and count, rebuild or
    delete the files in them."""
    from tiny_run import REPO

    from launcher.envs.torchenv import clean_env
    from launcher.runs.files import ENV_QUANT_CACHE_DIR, ENV_TEXT_CACHE_DIR

    return {**clean_env(), "PYTHONPATH": str(REPO), ENV_QUANT_CACHE_DIR: str(caches / "quantized"),
            ENV_TEXT_CACHE_DIR: str(caches / "text")}


@pytest.fixture
def scale_derivations(trainer_on_path, monkeypatch) -> list:
    """Grows by one each time int4_w4a8 derives a weight's 8-bit scales (a pass over the weight)."""
    from toolkit import int4_w4a8

    derived = []

    class Counted(int4_w4a8.WeightScales):
        def __init__(self, *args):
            derived.append(1)
            super().__init__(*args)

    monkeypatch.setattr(int4_w4a8, "WeightScales", Counted)
    return derived


def is_quantized_linear(module) -> bool:
    """A Linear quantized by either backend a target uses for uint4: the fork's torchao swaps the
    weight for a tensor subclass; upstream's OstrisLinear keeps it in buffers (its `.weight` is
    a dequantized plain tensor, so the flag is read first)."""
    if getattr(module, "is_ostris_quantized", False):
        return True
    return type(module.weight) not in (torch.Tensor, torch.nn.Parameter)


def dense_weight(module) -> torch.Tensor:
    """A quantized Linear's weight, dequantized (either backend)."""
    if getattr(module, "is_ostris_quantized", False):
        return module.dequantize_weight()
    weight = module.weight
    return weight.dequantize() if hasattr(weight, "dequantize") else weight


def plain_linears(module) -> list[str]:
    """Names of the Linears under `module` whose weight is a plain (not quantized) tensor."""
    return [name for name, m in module.named_modules() if isinstance(m, torch.nn.Linear) and not is_quantized_linear(m)]


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


@pytest.fixture(scope="module")
def tiny_assets(trainer_on_path, tmp_path_factory):
    """The embedded tiny FLUX.2's files, built once per test module; its manifest."""
    from launcher.in_trainer import tiny_assets
    from launcher.runs import tiny

    out = tmp_path_factory.mktemp("tiny-assets")
    tiny_assets.build(trainer_on_path, out, seed=0)
    return tiny.read_manifest(out, seed=0)


@pytest.fixture(scope="module")
def flux2_model(trainer_on_path):
    return importlib.import_module("extensions_built_in.diffusion_models.flux2.flux2_model")

"""The preset's `launcher:` block: the keys only the launcher reads; the trainer never sees them.

In the catalogue's form (flux2_contract/settings.py `Setting`), so the schema checks them by the
same rules and docs/options.md lists them beside the trainer's settings.
"""

from flux2_contract.settings import Setting

BLOCK = "launcher"


def _setting(name, kind, default, doc, **more) -> Setting:
    return Setting(name, BLOCK, kind, default, doc, **more)


SETTINGS = {item.name: item for item in (
    _setting("tiny", "bool", False, "build and train the embedded tiny FLUX.2 (tests, CI)"),
    _setting("card", "text", None, "the cards the preset is for (`python -m launcher presets`)"),
    _setting("env", "mapping", {}, "extra environment of the trainer process, from an allow list"),
    _setting("platform", "choice", "cuda", "what the preset was tuned for", choices=("rocm", "cuda", "cpu")),
    _setting("allocator", "choice", "expandable_segments", "wall 7: expandable segments; default leaves "
        "PyTorch's allocator alone", choices=("expandable_segments", "default")),
    _setting("telemetry", "mapping", {"interval_s": 10}, "telemetry rows: interval_s seconds apart"),
    _setting("watchdog", "mapping", {"enabled": False}, "the stall watchdog (launcher/watchdog/policy.py)"),
    _setting("skip_bad_images", "bool", False, "train without the dataset files that fail the checks"),
    _setting("gpus", "int", 1, "GPUs of this machine to train on, one rank each, data-parallel (`run --gpus N` "
        "overrides it): the batch size is per rank", minimum=1, maximum=64),
    _setting("sampling", "choice", "auto", "wall 6: in-training samples where the self-test sampled (auto), or "
        "always (force)", choices=("auto", "force")),
)}

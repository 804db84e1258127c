"""The names the launcher and the patched trainer agree on, and what `run` hands the trainer.

The trainer cannot import the launcher, so its side (overlay/ and the patches) spells these
names itself; tests/test_layout.py checks that every one of them is spelled the same there.
Everything else `run` tells the trainer travels in the run's config.yaml as model_kwargs settings
(`hand_over`), which the trainer reads through the settings catalogue, never the environment.
"""

import copy

SAVE_NOW = "SAVE_NOW"
"""Flag file in the job folder: the train loop saves a checkpoint and goes on."""
STOP_NOW = "STOP_NOW"
"""Flag file in the job folder: the train loop saves a checkpoint and exits."""
CHECKPOINT_MANIFEST = "checkpoint.json"
"""Written last by an atomic save: the checkpoint it names is complete."""
TEXT_ENCODER_RECORD = "encoder-{}.json"
"""In the text cache: the identity last seen at an encoder folder; {} is a hash of its path."""

PROFILE_DIR = "profile"
"""`run --profile N`: where the profile of N whole steps goes (model_kwargs profile_dir)."""
PROFILE_TRACE = "trace.json"
"""Chrome trace of the profiled steps (chrome://tracing, ui.perfetto.dev)."""
PROFILE_TABLE = "top20.txt"
"""The 20 operators with the most GPU time, the 20 with the most CPU time, and a summary line."""
PROFILE_BREAKDOWN = "breakdown.json"
"""Milliseconds per step by category (block GEMMs, requantization, attention, ...) and phase."""

SHARED_WITH_TRAINER = (SAVE_NOW, STOP_NOW, CHECKPOINT_MANIFEST, TEXT_ENCODER_RECORD, PROFILE_TRACE, PROFILE_TABLE,
                       PROFILE_BREAKDOWN)

ENV_QUANT_CACHE_DIR = "AITK_QUANT_CACHE_DIR"
ENV_TEXT_CACHE_DIR = "AITK_TEXT_CACHE_DIR"
"""Read by `run` from its own shell only: where the workdir's quantized and text caches go instead
(walls 8, 3-4); the trainer is handed the folders in its config and reads no variable."""


def hand_over(config: dict, written: dict, fallbacks: dict, launch_plans: list | tuple = ()) -> dict:
    """The config with what `run` hands the trainer, as model_kwargs settings of every process (each
    marked `written_by_run` in overlay/toolkit/settings.py): `written` replaces the preset's value (the
    run folder's files, the profiler), `fallbacks` fills only what the preset leaves unset (the caches),
    and `launch_plans` gives each process the memory plan `run` made for it (launch_plan; none where
    the entry is None or missing: the trainer plans from the VRAM it finds). `config` stays as it was."""
    config = copy.deepcopy(config)
    for index, process in enumerate(config["config"]["process"]):
        if "model" in process:
            kwargs = process["model"].setdefault("model_kwargs", {})
            kwargs.update({name: value for name, value in fallbacks.items() if kwargs.get(name) is None})
            kwargs.update(written)
            kwargs.pop("launch_plan", None)
            if index < len(launch_plans) and launch_plans[index] is not None:
                kwargs["launch_plan"] = launch_plans[index]
    return config

"""What `run` hands the trainer: model_kwargs settings in the run's config.yaml.

The file names both sides agree on are the contract's (flux2_contract/files.py); everything else
`run` tells the trainer travels in the run's config as model_kwargs settings (`hand_over`), which
the trainer reads through the settings catalogue, never the environment.
"""

import copy

ENV_QUANT_CACHE_DIR = "AITK_QUANT_CACHE_DIR"
ENV_TEXT_CACHE_DIR = "AITK_TEXT_CACHE_DIR"
"""Read by `run` from its own shell only: where the workdir's quantized and text caches go instead
(walls 8, 3-4); the trainer is handed the folders in its config and reads no variable."""


def hand_over(config: dict, written: dict, fallbacks: dict, launch_plans: list | tuple = ()) -> dict:
    """The config with what `run` hands the trainer, as model_kwargs settings of every process (each
    marked `written_by_run` in flux2_contract/settings.py): `written` replaces the preset's value (the
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

"""Every setting of a rendered config resolved once, before the trainer starts.

`run` turns each `auto` into a value (the qtype and its kernel, the stream mode, compiling the
blocks, the ROCm BLAS library, in-training sampling: launcher/selftest/verdict.py decides them
from the self-test), then writes every model_kwargs setting of the catalogue
(overlay/toolkit/settings.py) as a concrete value into the run's config.yaml. The trainer reads
them back through the same catalogue, never an `auto` and never an environment variable.
"""

from launcher import trainer_rules
from launcher.envs.workdir import Workdir
from launcher.selftest import verdict


def resolve_all(config: dict, workdir: Workdir, sampling: str) -> list[str]:
    """Resolve the rendered config in place; returns the lines `run` prints about each choice."""
    lines = [*verdict.resolve_config(config, workdir), verdict.resolve_sampling(config, workdir, sampling),
             verdict.resolve_stream_mode(config, workdir), verdict.resolve_compile_blocks(config, workdir),
             verdict.resolve_rocm_blas(config, workdir)]
    for process in config["config"]["process"]:
        model = process.get("model") or {}
        model["model_kwargs"] = concrete(model.get("model_kwargs") or {})
    return [line for line in lines if line]


def concrete(kwargs: dict) -> dict:
    """model_kwargs with every catalogue setting given its value: an `auto` left where it does not
    apply (a stream mode without a plan, a kernel of another qtype) takes the default."""
    settings = trainer_rules.settings()
    unused = {name for name, item in settings.CATALOGUE.items() if item.auto == settings.RUN and kwargs.get(name) == settings.AUTO}
    return settings.complete({key: value for key, value in kwargs.items() if key not in unused})

"""`model_kwargs.flux2_params`: the transformer's shape, checked before the model is built.

The keys and bounds of the trainer's Flux2Params (extensions_built_in/diffusion_models/flux2/src/model.py),
and the arithmetic between them that the trainer's Flux2 refuses as it builds the model, minutes in.
"""

from flux2_contract.families import FLUX2_DEV
from launcher.runs.schema_nodes import Block, ListOf, Vocabulary, number, whole

MAX_SHAPE = 65536
"""A size in flux2_params: ten times FLUX.2 [dev]'s widest (hidden_size 6144, context_in_dim 15360)."""

FLUX2_PARAMS = Block({
    **{name: whole(1, MAX_SHAPE) for name in ("in_channels", "context_in_dim", "hidden_size", "num_heads", "depth",
                                              "depth_single_blocks")},
    "theta": whole(1, 10**9),
    "axes_dim": ListOf(whole(1, MAX_SHAPE), min_items=1),
    "mlp_ratio": number(maximum=64, above=0),
})


def flux2_params_problems(data: dict) -> list[str]:
    """Shapes the trainer's Flux2 refuses as it builds the model (minutes in): heads that do not
    divide the hidden size, rotary axes that do not add up to the head size."""
    problems = []
    for index, process in enumerate(_processes(data)):
        kwargs = (process.get("model") or {}).get("model_kwargs") if isinstance(process.get("model"), dict) else None
        params = kwargs.get("flux2_params") if isinstance(kwargs, dict) else None
        if not isinstance(params, dict) or any(problem for problem in FLUX2_PARAMS.check(params, "", Vocabulary())):
            continue
        where = f"config.process[{index}].model.model_kwargs.flux2_params"
        shape = {**FLUX2_DEV.shape, **params}  # an unset key is the trainer's default, FLUX.2 [dev]'s
        hidden, heads, axes = (shape[key] for key in ("hidden_size", "num_heads", "axes_dim"))
        if hidden % heads:
            problems.append(f"{where}: hidden_size {hidden} is not a multiple of num_heads {heads}; the trainer "
                            "refuses this shape when it builds the model")
        elif sum(axes) != hidden // heads:
            problems.append(f"{where}: axes_dim {axes} adds up to {sum(axes)}, not hidden_size / num_heads = "
                            f"{hidden // heads}; the trainer refuses this shape when it builds the model")
    return problems


def _processes(data: dict) -> list[dict]:
    config = data.get("config")
    process = config.get("process") if isinstance(config, dict) else None
    return [item for item in process if isinstance(item, dict)] if isinstance(process, list) else []

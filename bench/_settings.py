"""The 4-bit kernel choice a bench script takes on its command line: `--kernel KEY=VALUE`.

The trainer picks the kernel of its 4-bit Linears from the run's model_kwargs (`w4a8_activations`,
`w4a8_gemm`, `int4_chunk_mib`, `int4_kernel`), defined in the settings catalogue
`flux2_contract/settings.py`, and nothing else. A bench script that calls the trainer's code
directly gives it those model_kwargs: each `--kernel` is one of them, its value read as a YAML
scalar (as in a preset) and checked by the catalogue's own rule before anything is loaded.
`auto` is refused: `python -m launcher run` resolves it from the self-test, and no run does here.

    python -m bench.train_step ... --weights int4_w4a8 --kernel w4a8_gemm=scaled_mm --kernel int4_chunk_mib=256

Stdlib only at import (PyYAML when a value is read): bench/train_step.py parses its flags before
it imports torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Tuple

from flux2_contract import settings

KERNEL_KEYS = ("w4a8_activations", "w4a8_gemm", "int4_chunk_mib", "int4_kernel")
"""The model_kwargs that choose how an Int4Linear multiplies (flux2_contract/qtypes.py, kernel_for)."""


def kernel_setting(text: str) -> Tuple[str, Any]:
    """One `--kernel KEY=VALUE` as (key, value); an argparse `type`, so a bad one ends the
    command with a message that names the key and what it allows."""
    key, equals, raw = text.partition("=")
    key = key.strip()
    if not equals or key not in KERNEL_KEYS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give KEY=VALUE, KEY one of the kernel settings {', '.join(KERNEL_KEYS)}")
    import yaml

    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        raise argparse.ArgumentTypeError(f"{key}={raw}: not a YAML scalar") from None
    # the catalogue's rule without `auto`: only `launcher run` resolves that, from the self-test
    setting = dataclasses.replace(settings.CATALOGUE[key], auto=None)
    value = setting.normal(value)
    if value == settings.AUTO:
        why = "auto is resolved by `python -m launcher run` from the self-test; name a value here"
    else:
        why = "not a single value" if isinstance(value, (dict, list)) else setting.problem(value)
    if why:
        raise argparse.ArgumentTypeError(f"{key}={raw}: {why}; allowed: {setting.allowed}")
    return key, value


def add_kernel_flag(parser: argparse.ArgumentParser) -> None:
    """`--kernel KEY=VALUE`, repeatable, into `args.kernel`: a list of (key, value), the model_kwargs
    as `dict(args.kernel)` (a later flag for the same key wins)."""
    parser.add_argument(
        "--kernel", action="append", default=[], type=kernel_setting, metavar="KEY=VALUE",
        help=f"a 4-bit kernel setting the trainer reads from model_kwargs ({', '.join(KERNEL_KEYS)}; "
             "flux2_contract/settings.py), e.g. --kernel w4a8_gemm=scaled_mm --kernel int4_chunk_mib=256; "
             "repeatable; unset ones take the qtype's defaults")

"""`launcher.watchdog` as the preset schema checks it: the keys and types of WatchdogConfig."""

from dataclasses import fields

from launcher.runs.schema_nodes import Block, Nullable, Text, flag, number, whole
from launcher.signals.gpu_sources import SOURCES
from launcher.watchdog.policy import WatchdogConfig

BASELINE_KEYS = ("clock_mhz", "power_w", "mem_load")


def watchdog_block() -> Block:
    """Every field of WatchdogConfig, typed from its annotation: non-negative numbers, a known source."""
    by_type = {"bool": flag(), "int": whole(0), "float": number(0),
               "str": Text(), "float | None": Nullable(number(0)),
               "dict | None": Nullable(Block({name: number(0) for name in BASELINE_KEYS},
                                             required=BASELINE_KEYS))}
    keys = {item.name: by_type[str(item.type)] for item in fields(WatchdogConfig)}
    keys["source"] = Text(("auto", *SOURCES))
    keys["interval_s"] = number(above=0)
    keys["samples"] = whole(1)
    return Block(keys)

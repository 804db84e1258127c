"""`launcher.watchdog` as the preset schema checks it: the keys and types of WatchdogConfig, each
number between bounds a human would still mean (a typo's extra digits are refused before a burst
of that size or a wait of that length starts)."""

from dataclasses import fields

from launcher.runs.schema_nodes import Block, Nullable, Text, flag, number, whole
from launcher.signals.gpu_sources import SOURCES
from launcher.watchdog.policy import WatchdogConfig

BASELINE_KEYS = ("clock_mhz", "power_w", "mem_load")
DAY = 86400
BOUNDS = {
    "interval_s": (None, 3600), "gpu": (0, 63), "rank_stall_s": (10, DAY), "samples": (1, 1000),
    "learn_samples": (0, 100_000), "clock_ratio": (0, 10), "power_ratio": (0, 10), "mem_ratio": (0, 10),
    "slow_ratio": (0, 100), "healthy_s_it": (0, DAY), "burst_s": (0, 3600), "burst_m": (0, 65536),
    "burst_k": (0, 65536), "burst_n": (0, 65536), "burst_timeout_s": (0, DAY), "dud_tflops": (0, 100_000),
    "max_respawns": (0, 1000), "prophylactic_after_start_s": (0, 7 * DAY), "prophylactic_after_save_s": (0, 7 * DAY),
    "cooldown_s": (0, DAY), "verify_steps": (0, 10_000), "verify_timeout_s": (0, DAY), "restore_ratio": (0, 100),
    "max_failed_bursts": (0, 1000),
}
"""(lowest, highest) of each number. rank_stall_s from 10 s: each rank's heartbeat comes every 2 s, and
a limit near it would take a rank the machine was slow to schedule for a frozen one."""
BASELINE_BOUNDS = {"clock_mhz": 10_000, "power_w": 5000, "mem_load": 100}


def _number(name: str, kind: str):
    low, high = BOUNDS[name]
    if kind == "int":
        return whole(low, high)
    return number(maximum=high, above=0) if low is None else number(low, high)


def watchdog_block() -> Block:
    """Every field of WatchdogConfig, typed from its annotation, numbers within BOUNDS, a known source."""
    keys = {}
    for item in fields(WatchdogConfig):
        kind = str(item.type)
        if kind == "bool":
            keys[item.name] = flag()
        elif kind in ("int", "float"):
            keys[item.name] = _number(item.name, kind)
        elif kind == "float | None":
            keys[item.name] = Nullable(_number(item.name, "float"))
        elif kind == "dict | None":
            keys[item.name] = Nullable(Block({name: number(0, BASELINE_BOUNDS[name]) for name in BASELINE_KEYS},
                                             required=BASELINE_KEYS))
        else:
            keys[item.name] = Text()
    keys["source"] = Text(("auto", *SOURCES))
    return Block(keys)

"""The file names the launcher and the patched trainer both write or read, spelled once.

The launcher imports them from here, the overlay's modules from the same package in the trainer
checkout (flux2_hooks reads SAVE_NOW and STOP_NOW from here; tests/test_layout.py holds the
patches and the overlay to these names).
"""

import os

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

TELEMETRY_FILE = "trainer-telemetry.jsonl"
"""In the run folder (model_kwargs telemetry_file): the trainer's in-process rows, rank 0's."""
RANK_STATE_FILE = "rank-state.json"
"""In the run folder (model_kwargs rank_state_file): named by `run`, never written under this name."""


def rank_file(path, rank: int) -> str:
    """Rank R's file beside `path`: `rank-state.json` -> `rank-state.rank<R>.json`,
    `trainer-telemetry.jsonl` -> `trainer-telemetry.rank<R>.jsonl`."""
    root, suffix = os.path.splitext(os.fspath(path))
    return f"{root}.rank{rank}{suffix}"

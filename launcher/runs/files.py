"""The names the launcher and the patched trainer agree on.

The trainer cannot import the launcher, so its side (overlay/ and the patches) spells these
names itself; tests/test_layout.py checks that every one of them is spelled the same there.
"""

SAVE_NOW = "SAVE_NOW"
"""Flag file in the job folder: the train loop saves a checkpoint and goes on."""
STOP_NOW = "STOP_NOW"
"""Flag file in the job folder: the train loop saves a checkpoint and exits."""
CHECKPOINT_MANIFEST = "checkpoint.json"
"""Written last by an atomic save: the checkpoint it names is complete."""
ENV_TELEMETRY = "AITK_TELEMETRY"
"""The JSONL file the train loop appends its in-process rows to (wall 10)."""
ENV_TELEMETRY_INTERVAL = "AITK_TELEMETRY_INTERVAL"
ENV_QUANT_CACHE_DIR = "AITK_QUANT_CACHE_DIR"
"""Where the quantized transformer is cached (wall 8): one folder per workdir."""
ENV_TEXT_CACHE_DIR = "AITK_TEXT_CACHE_DIR"
"""Where the text phase caches prompt embeddings (walls 3-4): one folder per workdir."""
TEXT_ENCODER_RECORD = "encoder-{}.json"
"""In the text cache: the identity last seen at an encoder folder; {} is a hash of its path."""

ENV_PROFILE_STEPS = "AITK_PROFILE_STEPS"
"""`run --profile N`: the train loop profiles N whole steps with torch.profiler."""
ENV_PROFILE_DIR = "AITK_PROFILE_DIR"
"""Where the profile goes: the run folder's PROFILE_DIR."""
PROFILE_DIR = "profile"
PROFILE_TRACE = "trace.json"
"""Chrome trace of the profiled steps (chrome://tracing, ui.perfetto.dev)."""
PROFILE_TABLE = "top20.txt"
"""The 20 operators with the most GPU time, the 20 with the most CPU time, and a summary line."""
PROFILE_BREAKDOWN = "breakdown.json"
"""Milliseconds per step by category (block GEMMs, requantization, attention, ...) and phase."""

SHARED_WITH_TRAINER = (SAVE_NOW, STOP_NOW, CHECKPOINT_MANIFEST, ENV_TELEMETRY, ENV_TELEMETRY_INTERVAL,
                       ENV_QUANT_CACHE_DIR, ENV_TEXT_CACHE_DIR,
                       ENV_PROFILE_STEPS, ENV_PROFILE_DIR, PROFILE_TRACE, PROFILE_TABLE, PROFILE_BREAKDOWN)

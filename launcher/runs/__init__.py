"""Runs: presets and their validation, run folders, telemetry, plots, the embedded tiny FLUX.2."""

"""Environments: torch channels and pins, the trainer's venv, host facts, what torch sees there."""

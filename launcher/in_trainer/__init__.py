"""Modules that run under the TRAINER's interpreter (its venv has torch, matplotlib, PIL).

Each is started with `python -m launcher.in_trainer.<name>` (the self-test's parts:
`selftest.<name>`) through `launcher.envs.trainer_python`. At module level they import only the
standard library, each other and flux2_contract/families.py (itself standard library only), so that the
trainer's venv, which has neither GitPython nor the launcher installed, can import them; heavy
imports (torch, ...) stay inside functions.
tests/test_layout.py keeps it that way, subpackages included.
"""

"""Launcher for QLoRA training of FLUX.2 [dev] on one 24 GB card.

Sets up a pinned, patched checkout of the ai-toolkit trainer and runs it.
"""

import os

__version__ = "0.10.0"

# GitPython refuses to import without a git executable; let it import so that the
# launcher can say how to install git instead (launcher.patching.gitops.require_git).
os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")

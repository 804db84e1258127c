"""Hypothesis draws from a fixed seed unless asked otherwise, so a suite's result depends on the
code alone and CI cannot fail on one unlucky draw; `HYPOTHESIS_PROFILE=explore` draws afresh, to
look for new damage (keep what it finds as a named case). Both conftests load it."""

import os

from hypothesis import settings

settings.register_profile("seeded", derandomize=True, database=None)
settings.register_profile("explore", database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "seeded"))

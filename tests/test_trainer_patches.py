"""Each target's in-trainer suite (tests/trainer_patches) passes in that target's trainer venv.

A test for a patch that a target's series does not carry (marker `patch`), or that reads
torchao's uint4 layout on a target whose uint4 is OstrisLinear (marker `torchao_uint4`), is
deselected there; tests marked `gpu` are deselected where the trainer's torch sees no GPU.
Anything else that skips fails the bridge.

The suites run in the background (tests/in_trainer_suites.py), started by InstalledWorkdirs as
soon as a target's workdir exists, so they overlap the launcher's own trainer tests; each test
here waits for its target's suite (the timings are in that module's docstring).
"""

import pytest
from conftest import TARGETS

pytestmark = pytest.mark.trainer


@pytest.fixture(scope="module")
def in_trainer_suites(installed_workdirs):
    """{target name: its Suite, or the outcome (fail/skip) of getting its workdir, which only that
    target's test re-raises}. A suite not yet started (its workdir not yet asked for) starts here."""
    suites = {}
    for target in TARGETS:
        try:
            suites[target.name] = installed_workdirs.suite(target.name)
        except (pytest.fail.Exception, pytest.skip.Exception) as outcome:
            suites[target.name] = outcome
    return suites


@pytest.mark.parametrize("target", TARGETS, ids=[t.name for t in TARGETS])
def test_in_trainer_suite_passes(in_trainer_suites, target):
    suite = in_trainer_suites[target.name]
    if isinstance(suite, BaseException):
        raise suite
    returncode, output, errors = suite.wait()
    print(output[-20000:], errors[-5000:])
    assert returncode == 0, f"the in-trainer suite failed on {target.name}; its report is above"
    summary = output.splitlines()[-1]
    assert " passed" in summary and " skipped" not in summary, summary

"""The test suite's own rules: an unreachable target skips locally and fails in CI, and a test
that needs a real target cannot leave out the `trainer` marker."""

from types import SimpleNamespace

import pytest
from conftest import (
    Target,
    pytest_collection_modifyitems,
    require_reachable,
    workdir_variable,
)

NOWHERE = Target(name="gone", url="file:///nonexistent/flux2-24gb-test-target", commit="0" * 40,
                 series=None)


def test_an_unreachable_target_skips_with_the_reason_on_a_developer_machine(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="cannot be cloned here"):
        require_reachable(NOWHERE)


@pytest.mark.parametrize("value", ["true", "True", "1"])
def test_an_unreachable_target_fails_in_ci(monkeypatch, value):
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        require_reachable(NOWHERE)


def test_ci_false_still_skips(monkeypatch):
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception):
        require_reachable(NOWHERE)


def item(nodeid, fixtures, marked):
    mark = pytest.mark.trainer.mark if marked else None
    return SimpleNamespace(nodeid=nodeid, fixturenames=fixtures, get_closest_marker=lambda name: mark)


def test_a_trainer_fixture_without_the_marker_stops_the_collection():
    items = [item("t::marked", ["trainer_workdir"], True), item("t::fast", ["tmp_path"], False),
             item("t::forgot", ["tmp_path", "target_workdir"], False)]
    with pytest.raises(pytest.UsageError, match="t::forgot") as info:
        pytest_collection_modifyitems(None, items)
    assert "t::marked" not in str(info.value) and "t::fast" not in str(info.value)


def test_marked_tests_pass_the_check():
    pytest_collection_modifyitems(None, [item("t::a", ["fork_reachable"], True), item("t::b", [], False)])


def test_workdir_variables_per_target():
    assert workdir_variable("amd-fork") == "LAUNCHER_TEST_WORKDIR"
    assert workdir_variable("upstream-main") == "LAUNCHER_TEST_WORKDIR_UPSTREAM_MAIN"

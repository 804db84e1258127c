"""bench/card_cap.py: the 44-block benchmark model's cap plans like the full FLUX.2 on the card,
and is the smallest that does."""

import pytest

from bench import card_cap
from flux2_contract import memory_plan

SHALLOW = {"depth_single_blocks": 36}


def shallow_shares(cap):
    return card_cap.shares(memory_plan.plan_for_budget(cap, 512, flux2_params=SHALLOW))


@pytest.mark.parametrize("free_gib", [22.0, 15.0, 11.0, 7.0])
def test_the_cap_keeps_the_full_models_resident_share_and_no_smaller_cap_does(free_gib):
    found = card_cap.emulated_cap(free_gib)
    full = card_cap.shares(memory_plan.plan_for_budget(free_gib, 512))
    assert shallow_shares(found["cap_gib"]) >= full
    smaller = round(found["cap_gib"] - card_cap.STEP_GIB, 2)
    try:
        assert shallow_shares(smaller) < full
    except memory_plan.PlanError:
        pass  # a smaller cap cannot even hold the plan's minimum


def test_a_card_that_streams_the_left_out_blocks_does_not_lose_their_bytes_twice():
    """11 GiB free: the full model streams the 12 single blocks the benchmark leaves out, so the cap
    stays above the free VRAM less their weights (8.3 GiB, the rule for resident plans)."""
    found = card_cap.emulated_cap(11.0)
    assert found["full"]["streamed_gib"] > 0
    assert 8.3 < found["cap_gib"] < 11.0


def test_a_card_the_full_model_cannot_train_on_is_refused_with_the_numbers(capsys):
    assert card_cap.main(["--free-gib", "3"]) == 2
    assert "cannot hold the resident minimum" in capsys.readouterr().err

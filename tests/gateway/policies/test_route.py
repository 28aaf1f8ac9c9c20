"""Routing policies are pure functions: plain numbers in, a decision out."""

from crossover.gateway.policies.route import (
    ABOVE,
    BELOW,
    BELOW_SHARE,
    HYSTERESIS,
    Decision,
    least_loaded,
    spillover,
    switch,
)


def test_spillover_fills_the_speculative_pool_up_to_the_threshold():
    assert [spillover(load, threshold=3).pool for load in range(5)] == [
        "speculative",
        "speculative",
        "speculative",
        "plain",
        "plain",
    ]
    assert spillover(2, 3) == Decision("speculative", BELOW)
    assert spillover(3, 3) == Decision("plain", ABOVE)


def test_spillover_threshold_zero_sends_everything_to_plain():
    assert spillover(0, 0) == Decision("plain", ABOVE)


def test_spillover_with_a_share_keeps_the_speculative_pool_at_its_share_of_a_high_load():
    # A closed loop of C clients, each new request seeing the others in flight: the speculative pool settles at
    # max(threshold, ceil(share x C)) of them.
    def settled(clients: int, threshold: int, share: float) -> int:
        speculative = 0
        for arrived in range(clients):
            speculative += spillover(speculative, threshold, arrived, share).pool == "speculative"
        return speculative

    assert [settled(c, 1, 0.5) for c in (1, 2, 4, 16, 64)] == [1, 1, 2, 8, 32]
    assert [settled(c, 3, 0.0) for c in (1, 4, 64)] == [1, 3, 3]  # no share: the threshold alone, as before
    assert [settled(c, 0, 0.25) for c in (1, 3, 64)] == [1, 1, 16]
    assert settled(64, 0, 1.0) == 64  # all of it: the plain pool only as fallback
    assert spillover(20, 1, total_load=63, share=0.5) == Decision("speculative", BELOW_SHARE)
    assert spillover(32, 1, total_load=63, share=0.5) == Decision("plain", ABOVE)
    assert spillover(0, 1, total_load=63, share=0.5) == Decision("speculative", BELOW)  # the threshold says first


def test_switch_goes_plain_at_the_threshold_and_comes_back_below_the_band():
    assert switch(7, threshold=8, hysteresis=2, current="speculative") == Decision("speculative", BELOW)
    assert switch(8, threshold=8, hysteresis=2, current="speculative") == Decision("plain", ABOVE)
    # Inside the band [threshold - hysteresis, threshold) the current side holds.
    assert switch(7, threshold=8, hysteresis=2, current="plain") == Decision("plain", HYSTERESIS)
    assert switch(6, threshold=8, hysteresis=2, current="plain") == Decision("plain", HYSTERESIS)
    assert switch(5, threshold=8, hysteresis=2, current="plain") == Decision("speculative", BELOW)


def test_switch_does_not_flap_on_a_load_hovering_at_the_threshold():
    side, sides = "speculative", []
    for load in [8, 7, 8, 7, 6, 7, 8, 7, 6, 5, 6, 7]:
        side = switch(load, threshold=8, hysteresis=2, current=side).pool
        sides.append(side)
    # Without hysteresis this would change sides eight times; with it: to plain once, back once at 5.
    assert sides == ["plain"] * 9 + ["speculative"] * 3


def test_switch_without_hysteresis_follows_the_threshold_exactly():
    side = "plain"
    assert switch(7, 8, 0, side).pool == "speculative"
    assert switch(8, 8, 0, "speculative").pool == "plain"


def test_least_loaded_picks_the_minimum_and_rotates_ties():
    assert least_loaded([3, 1, 2]) == 1
    assert least_loaded([]) is None
    assert {least_loaded([0, 0, 0], start) for start in range(3)} == {0, 1, 2}
    assert least_loaded([1, 0, 0], start=0) == 1
    assert least_loaded([1, 0, 0], start=2) == 2


def test_every_policy_name_has_its_function_and_only_those():
    from typing import get_args

    from crossover.gateway.policies import POLICIES, PolicyName

    assert set(POLICIES) == set(get_args(PolicyName))


def test_a_priority_request_takes_the_speculative_pool_above_the_threshold_up_to_the_headroom():
    from crossover.gateway.policies.route import PRIORITY_TIER, for_tier

    above = spillover(40, threshold=32)
    moved = for_tier(above, "priority", 40, priority_headroom=64, plain_usable=True)
    assert moved == Decision("speculative", PRIORITY_TIER)
    # At the headroom the speculative pool is full for priority too: the load's decision stands.
    assert for_tier(above, "priority", 64, priority_headroom=64, plain_usable=True) == above
    # Below the threshold it needs no help: the reason stays the load's.
    below = spillover(3, threshold=32)
    assert for_tier(below, "priority", 3, priority_headroom=64, plain_usable=True) == below
    # Threshold 0 (everything plain): priority still gets the speculative pool.
    assert for_tier(spillover(0, 0), "priority", 0, 64, True).pool == "speculative"


def test_a_flex_request_takes_plain_while_plain_can_serve():
    from crossover.gateway.policies.route import FLEX_TIER, for_tier

    below = spillover(0, threshold=32)
    assert for_tier(below, "flex", 0, 64, plain_usable=True) == Decision("plain", FLEX_TIER)
    assert for_tier(below, "flex", 0, 64, plain_usable=False) == below  # no plain backend: speculative serves
    above = spillover(40, threshold=32)
    assert for_tier(above, "flex", 40, 64, True) == above


def test_auto_default_and_no_tier_keep_the_loads_decision():
    from crossover.gateway.policies.route import TIERS, for_tier

    assert TIERS == ("auto", "default", "flex", "priority")
    for decision in (spillover(0, 32), spillover(40, 32), switch(40, 32, 4, "plain"), switch(30, 32, 4, "plain")):
        for tier in ("auto", "default", None):
            assert for_tier(decision, tier, 40, 64, True) is decision

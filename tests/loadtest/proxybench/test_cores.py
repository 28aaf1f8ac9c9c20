"""Core sets: the CPU list syntax both ways, and the refusals (overlap, a core the host lacks) that name the flag."""

from __future__ import annotations

import pytest

from crossover.loadtest.proxybench.cores import CoreError, CoreSets, format_cpu_list, parse_cpu_list

HOST = frozenset(range(16))


def test_cpu_lists_read_and_write_as_taskset_does():
    assert parse_cpu_list("0-3,8, 10-11") == {0, 1, 2, 3, 8, 10, 11}
    assert format_cpu_list(frozenset({0, 1, 2, 3, 8, 10, 11})) == "0-3,8,10-11"
    assert format_cpu_list(parse_cpu_list("5")) == "5"


@pytest.mark.parametrize("text", ["", "a", "3-1", "-1", "0-", "1,,2"])
def test_a_malformed_list_is_refused(text):
    with pytest.raises(CoreError, match=r"CPU list|range"):
        parse_cpu_list(text)


def test_the_issue_31_layout_is_accepted_and_unset_roles_stay_unpinned():
    sets = CoreSets.parse("0-3", "4-9", "10-15", available=HOST)
    assert (sets.backend, sets.gateway, sets.load) == (
        frozenset(range(4)),
        frozenset(range(4, 10)),
        HOST - set(range(10)),
    )
    assert CoreSets.parse(gateway="1", available=HOST) == CoreSets(gateway=frozenset({1}))
    assert CoreSets.parse(available=HOST) == CoreSets()


def test_overlapping_sets_are_refused_naming_both_flags_and_the_shared_cores():
    with pytest.raises(CoreError) as caught:
        CoreSets.parse("0-3", "3-8", available=HOST)
    assert str(caught.value) == "--cores-backend 0-3 and --cores-gateway 3-8 share core(s) 3: the sets must be disjoint"


def test_a_core_this_host_lacks_is_refused():
    with pytest.raises(
        CoreError, match=r"--cores-load 14-17: core\(s\) 16-17 not on this host \(this process may use 0-15\)"
    ):
        CoreSets.parse(load="14-17", available=HOST)


def test_the_load_set_is_dealt_out_among_the_generators():
    sets = CoreSets(load=frozenset(range(10, 16)))
    assert sets.split_load(6) == [frozenset({core}) for core in range(10, 16)]
    assert sets.split_load(2) == [frozenset({10, 12, 14}), frozenset({11, 13, 15})]
    assert sets.split_load(8) == [sets.load] * 8  # more generators than cores: all share the set
    assert CoreSets().split_load(3) == [None, None, None]

"""The seal on what members write: only a holder of the cluster's key writes a value that opens, under its own key."""

from __future__ import annotations

import pytest

from crossover.gateway.cluster.signing import Seal

KEY = "k" * 32


def test_a_sealed_value_opens_under_its_key_and_only_there():
    seal = Seal(KEY)
    stored = seal.close("n:control", '{"threshold": 8}')
    assert stored != '{"threshold": 8}'
    assert seal.open("n:control", stored) == '{"threshold": 8}'
    with pytest.raises(ValueError, match="changed since"):
        seal.open("n:inflight:other", stored)  # copied under another key
    with pytest.raises(ValueError, match="changed since"):
        seal.open("n:control", stored.replace("8", "9"))
    with pytest.raises(ValueError, match="changed since"):
        Seal("x" * 32).open("n:control", stored)


def test_without_the_seal_a_value_is_refused_and_without_a_key_a_sealed_one_is():
    with pytest.raises(ValueError, match="not sealed with the cluster's key"):
        Seal(KEY).open("n:control", '{"threshold": 8}')
    with pytest.raises(ValueError, match="has not got"):
        Seal("").open("n:control", Seal(KEY).close("n:control", "{}"))
    assert Seal("").close("n:control", "{}") == "{}" == Seal("").open("n:control", "{}")

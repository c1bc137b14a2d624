"""Sharing strategies: names, default, environment, validation, inheritance by children."""
import multiprocessing
import os

import pytest

import sharedmp as mp
from sharedmp import strategy
from sharedmp.arrays import mapping_of

import _workers as w

ENV = "SHAREDMP_SHARING_STRATEGY"


def test_all_strategies():
    assert mp.get_all_sharing_strategies() == {"file_descriptor", "file_system"}
    assert strategy.ENV == ENV


def test_default_is_file_descriptor(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    strategy.reload_from_environment()          # as at the start of a process
    assert mp.get_sharing_strategy() == "file_descriptor"
    monkeypatch.setenv(ENV, "")
    strategy.reload_from_environment()
    assert mp.get_sharing_strategy() == "file_descriptor"


def test_environment_overrides_default(monkeypatch):
    monkeypatch.setenv(ENV, "file_system")
    strategy.reload_from_environment()
    assert mp.get_sharing_strategy() == "file_system"


def test_set_and_get():
    mp.set_sharing_strategy("file_system")
    assert mp.get_sharing_strategy() == "file_system" and os.environ[ENV] == "file_system"
    mp.set_sharing_strategy("file_descriptor")
    assert mp.get_sharing_strategy() == "file_descriptor"


def test_unknown_name_lists_valid_ones():
    mp.set_sharing_strategy("file_system")
    with pytest.raises(ValueError) as e:
        mp.set_sharing_strategy("nope")
    text = str(e.value)
    assert "nope" in text and "file_descriptor" in text and "file_system" in text
    assert mp.get_sharing_strategy() == "file_system"       # unchanged
    for bad in ("", "FILE_SYSTEM", None):
        with pytest.raises(ValueError):
            mp.set_sharing_strategy(bad)


def test_bad_environment_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(ENV, "shm")
    strategy.reload_from_environment()
    with pytest.raises(ValueError) as e:
        mp.get_sharing_strategy()
    assert ENV in str(e.value) and "shm" in str(e.value) and "file_descriptor" in str(e.value)
    with pytest.raises(ValueError, match=ENV):
        mp.zeros(3)                                         # allocation reports it too


def test_strategy_decides_the_kind_of_new_memory():
    mp.set_sharing_strategy("file_system")
    small, big = mp.zeros(3), mp.zeros(1 << 18)
    assert mapping_of(small)[1].kind == mapping_of(big)[1].kind == "file_system"
    mp.set_sharing_strategy("file_descriptor")
    small2, big2 = mp.zeros(3), mp.zeros(1 << 18)
    assert mapping_of(small2)[1].kind == mapping_of(big2)[1].kind == "file_descriptor"
    assert (small == 0).all() and (big == 0).all()          # earlier arrays are unaffected


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_children_inherit_the_choice(method):
    ctx = multiprocessing.get_context(method)
    mp.set_sharing_strategy("file_system")
    assert w.run(ctx, w.report_strategy) == "file_system"
    mp.set_sharing_strategy("file_descriptor")
    assert w.run(ctx, w.report_strategy) == "file_descriptor"

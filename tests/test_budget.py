"""Budget parsing, validation and the entries each row keeps."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from criticalkv.budget import Budget
from criticalkv.errors import BudgetError, CriticalKVError


@pytest.mark.parametrize(
    "bad",
    [0, 0.0, -1, -0.5, 1.5, 2.0, 1.0000001, float("nan"), float("inf"), float("-inf"), True, False, None, [0.2]],
)
def test_invalid_budgets_raise(bad):
    with pytest.raises(BudgetError):
        Budget(bad)


def test_budget_error_is_a_criticalkv_value_error():
    with pytest.raises(CriticalKVError):
        Budget(0)
    with pytest.raises(ValueError):
        Budget(-3)


@pytest.mark.parametrize("good", [1, 2, 512, 10**9, 1e-3, 0.2, 0.5, 1.0])
def test_valid_budgets(good):
    assert Budget(good).value == good


@pytest.mark.parametrize(
    ("text", "value", "kind"),
    [
        ("512", 512, int),
        (" 512 ", 512, int),
        ("2", 2, int),
        ("0.2", 0.2, float),
        ("1.0", 1.0, float),
        (".5", 0.5, float),
        ("1e-1", 0.1, float),
    ],
)
def test_parse_strings(text, value, kind):
    b = Budget.parse(text)
    assert type(b.value) is kind
    assert b.value == value


@pytest.mark.parametrize("text", ["0", "0.0", "-1", "-0.2", "1.5", "nan", "inf", "abc", "", "20%", "1e3", "1"])
def test_parse_bad_strings(text):
    with pytest.raises(BudgetError):
        Budget.parse(text)


def test_parse_passthrough_and_numbers():
    b = Budget(0.3)
    assert Budget.parse(b) is b
    assert Budget.parse(7) == Budget(7)
    assert Budget.parse(0.25) == Budget(0.25)
    with pytest.raises(BudgetError):
        Budget.parse(True)
    with pytest.raises(BudgetError):
        Budget.parse(0)


def test_kind_flags():
    assert Budget(0.2).is_fraction
    assert not Budget(512).is_fraction
    assert Budget(1.0).keeps_everything
    assert not Budget(1).keeps_everything  # the integer 1 is one token, not "everything"
    assert not Budget(0.99).keeps_everything
    assert str(Budget(0.2)) == "0.2"
    assert str(Budget(512)) == "512 entries per head"
    assert str(Budget(1)) == "1 entry per head"
    assert str(Budget(1.0)) == "1.0" and str(Budget(1 - 0.8)) == "0.2"  # not "1", which reads as one entry


def test_entries_for_fraction_floors():
    lengths = torch.tensor([4096, 4095, 10, 7, 100, 1])
    got = Budget(0.2).entries_for(torch.tensor([4096, 4095, 10, 7, 100]))
    assert got.tolist() == [819, 819, 2, 1, 20]
    assert got.dtype == torch.long
    assert Budget(0.5).entries_for(torch.tensor([9, 11, 2, 3])).tolist() == [4, 5, 1, 1]
    assert Budget(1.0).entries_for(lengths).tolist() == lengths.tolist()


def test_entries_for_fraction_matches_exact_floor():
    for frac in (0.1, 0.2, 0.25, 0.3, 0.5, 0.7, 0.9, 1.0):
        exact = Fraction(str(frac))  # the decimal as written
        lengths = [n for n in range(1, 5000) if math.floor(exact * n) >= 1]
        got = Budget(frac).entries_for(torch.tensor(lengths)).tolist()
        want = [math.floor(exact * n) for n in lengths]
        assert got == want, frac


def test_entries_for_fraction_rounding_to_zero_raises():
    with pytest.raises(BudgetError, match="row 1's 4-token context rounds to zero"):
        Budget(0.2).entries_for(torch.tensor([100, 4]))
    with pytest.raises(BudgetError):
        Budget(0.001).entries_for(torch.tensor([999]))
    # exactly one entry is fine
    assert Budget(0.001).entries_for(torch.tensor([1000])).tolist() == [1]


def test_entries_for_empty_rows_are_not_an_error():
    assert Budget(0.2).entries_for(torch.tensor([0, 10])).tolist() == [0, 2]
    assert Budget(5).entries_for(torch.tensor([0, 10])).tolist() == [0, 5]


def test_entries_for_count_clamps_to_length():
    got = Budget(16).entries_for(torch.tensor([3, 16, 17, 1000]))
    assert got.tolist() == [3, 16, 16, 16]
    assert got.dtype == torch.long
    assert Budget(10**6).entries_for(torch.tensor([5, 50])).tolist() == [5, 50]


def test_entries_never_exceed_length():
    lengths = torch.arange(2, 300)  # floor(0.999 * 1) would round to zero entries
    for b in (Budget(1.0), Budget(0.999), Budget(1), Budget(150), Budget(10**6)):
        got = b.entries_for(lengths)
        assert bool((got <= lengths).all())
        assert bool((got >= 1).all())


def test_count_one_is_refused_with_the_fraction_it_likely_meant():
    """``1`` would keep one entry per KV head, fewer than any observation window: a user meaning "everything" gets
    told to write 1.0; ``Budget(1)`` builds that budget on purpose."""
    for value in (1, "1", " 1 "):
        with pytest.raises(BudgetError, match=r"Write 1\.0 to keep everything"):
            Budget.parse(value)
    assert Budget.parse("1.0").keeps_everything and Budget.parse(1.0).keeps_everything
    assert Budget.parse(Budget(1)).value == 1

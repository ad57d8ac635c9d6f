"""Budgets: how many cached entries a row keeps, as a fraction of its context or as a token count."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from criticalkv.errors import BudgetError


def _as_float(value: numbers.Real) -> float:
    """A real number as the decimal it reads as: numpy's float32 0.7 is 0.699999988 as a float, which keeps one entry
    of 1000 fewer than 0.7 does; its shortest decimal (what ``str`` prints, the fewest digits that read back as the
    same float32) is 0.7. Python floats and float64 scalars are exact already."""
    if isinstance(value, float) or getattr(getattr(value, "dtype", None), "itemsize", 8) >= 8:
        return float(value)
    return float(str(value))


@dataclass(frozen=True)
class Budget:
    """A compression budget.

    Parameters
    ----------
    value
        A float in (0, 1] is a fraction of each row's context (``0.2`` keeps 20%); an int >= 1 is a number
        of entries per KV head (``512``). ``1.0`` keeps everything.
    """

    value: float | int

    def __post_init__(self) -> None:
        v = self.value
        if isinstance(v, numbers.Integral) and not isinstance(v, bool):
            object.__setattr__(self, "value", v := int(v))
        elif isinstance(v, numbers.Real) and not isinstance(v, bool):
            object.__setattr__(self, "value", v := _as_float(v))
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise BudgetError(f"budget must be a number, got {v!r}")
        if isinstance(v, float) and not math.isfinite(v):
            raise BudgetError(f"budget must be finite, got {v!r}")
        if v <= 0:
            raise BudgetError(f"budget must be > 0, got {v!r}")
        if isinstance(v, float) and v > 1:
            raise BudgetError(
                f"a fractional budget must be in (0, 1], got {v!r}; for a token count pass an integer such as 512"
            )

    @classmethod
    def parse(cls, value: Budget | float | int | str) -> Budget:
        """Read ``0.2``, ``512``, ``"0.2"`` or ``"512"``; integers are token counts, decimals fractions.

        What a user writes: the count ``1`` is refused (one entry per KV head, fewer than any observation window:
        most likely meant as ``1.0``, everything); ``Budget(1)`` itself is allowed.
        """
        if isinstance(value, Budget):
            return value
        if isinstance(value, str):
            text = value.strip()
            try:
                number: float | int = int(text) if text.isdigit() else float(text)
            except ValueError:
                raise BudgetError(
                    f"cannot read budget {value!r}: use a fraction like 0.2 or a count like 512"
                ) from None
            budget = cls(number)
        else:
            budget = cls(value)
        if budget.value == 1 and not budget.is_fraction:
            raise BudgetError(
                "budget 1 is a count: one entry per KV head. Write 1.0 to keep everything, a fraction such as 0.2, "
                "or a count of at least 2 entries (Budget(1) builds it on purpose)"
            )
        return budget

    @property
    def is_fraction(self) -> bool:
        return isinstance(self.value, float)

    @property
    def keeps_everything(self) -> bool:
        return self.is_fraction and self.value == 1.0

    def entries_for(self, lengths: torch.Tensor, whole: torch.Tensor | None = None) -> torch.Tensor:
        """Entries to keep per row, given each row's real context length: (b,) long -> (b,) long.

        A fraction is floored (``floor(0.2 * 4096) = 819``); the result never exceeds the row's length, and a
        fraction that rounds to zero entries is an error, except in the rows of ``whole`` ((b,) bool: rows kept
        whole anyway, e.g. no longer than the scorer's window), which keep their length.
        """
        if self.is_fraction:
            # The small tolerance makes 0.2 * 4095 (= 818.99999...) count as 819, as the decimal reads.
            n = torch.floor(lengths.double() * self.value + 1e-9).long()
        else:
            n = torch.full_like(lengths, int(self.value))
        if whole is not None:
            n = torch.where(whole, lengths, n)
        short = (n < 1) & (lengths > 0)  # only a fraction can round to zero: a count is >= 1
        if bool(short.any()):
            row = int(short.nonzero()[0])
            raise BudgetError(
                f"budget {self.value} of row {row}'s {int(lengths[row])}-token context rounds to zero entries: raise "
                "the budget, give an entry count, or leave the row out"
            )
        return torch.minimum(n, lengths)

    def __str__(self) -> str:
        if self.is_fraction:  # "0.2"; "1.0", not "1", which reads as the count of one entry
            text = f"{self.value:g}"
            return text if "." in text or "e" in text else f"{text}.0"
        return f"{self.value} {'entry' if self.value == 1 else 'entries'} per head"

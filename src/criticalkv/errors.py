"""Errors raised by criticalkv. All derive from ``CriticalKVError`` (itself a ``ValueError``)."""

import difflib
from collections.abc import Iterable


class CriticalKVError(ValueError):
    """Base class of every error criticalkv raises on bad input."""


class UnsupportedModelError(CriticalKVError):
    """The model's architecture is not one criticalkv knows how to compress."""


class BudgetError(CriticalKVError):
    """A budget that cannot be applied (<= 0, a fraction above 1, or one that rounds to zero)."""


class UnknownMethodError(CriticalKVError):
    """A method preset name, or an option of one, that does not exist."""


class MethodOptionError(CriticalKVError):
    """A method option whose value has the wrong type or is out of range for the piece it sets."""


class NegativeScoreError(CriticalKVError):
    """Scores fed to a selector that multiplies them by value norms (CriticalKV, DefensiveKV) are negative, so
    attention x value-norm would mean nothing (``Method`` checks)."""


class PaddingError(CriticalKVError):
    """A batch row with padding after a real token: criticalkv needs left padding."""


class CacheStateError(CriticalKVError):
    """A cache used in a way its state does not allow (e.g. cropping into the compressed context)."""


class UnreadableFileError(CriticalKVError):
    """A file criticalkv reads back (a sweep folder's ``sweep.json`` or ``methods.json``, a saved report) that is
    missing its content, not UTF-8 or not JSON: the message names the file and what to do."""


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` Did you mean 'snapkv'?`` for a ``word`` close to one of ``choices`` (a typo), else ''."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""


class StoredContextError(CriticalKVError):
    """A saved context that cannot be loaded here: made for another model (config or weights), another dtype or
    another file layout version, or not a criticalkv file at all."""


class BoundedMemoryError(CriticalKVError):
    """A method that cannot compress a cache again and again (chunked prefill, compression while decoding): the
    message names the method and what it would need."""

"""Distinct line colours for plots with any number of methods (matplotlib's default cycle repeats after 10)."""

from __future__ import annotations

import matplotlib


def distinct_colours(n: int) -> list[tuple[float, float, float, float]]:
    """``n`` RGBA colours, all different: tab10 up to 10, tab20 up to 20, then evenly spaced on turbo."""
    if n <= 10:
        return [matplotlib.colormaps["tab10"](i) for i in range(n)]
    if n <= 20:
        return [matplotlib.colormaps["tab20"](i) for i in range(n)]
    return [matplotlib.colormaps["turbo"](i / (n - 1)) for i in range(n)]

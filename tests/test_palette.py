"""Line colours of the plots: one distinct colour per method, however many methods."""

from hypothesis import given
from hypothesis import strategies as st

from criticalkv.palette import distinct_colours


@given(n=st.integers(min_value=0, max_value=64))
def test_every_method_gets_its_own_colour(n: int) -> None:
    colours = distinct_colours(n)
    assert len(colours) == n and len(set(colours)) == n

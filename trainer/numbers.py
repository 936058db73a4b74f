"""The number checks every config section makes (trainer/config.py, trainer/model/config.py):
a NaN passes any `x < 0` check and a bool is an int, so both are refused by name."""

from __future__ import annotations

import math


def finite(x) -> bool:
    """A real int or float (not a bool) that is neither infinite nor NaN."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def positive(x) -> bool:
    """finite and above zero."""
    return finite(x) and x > 0

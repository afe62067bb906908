"""What a training loop hands the monitor (Python numbers, numpy scalars, MindSpore tensors
of one element) as the plain numbers a step packet carries."""

from __future__ import annotations

from typing import Any


def as_number(x: Any) -> float | None:
    """A Python float from a number, a numpy scalar or a MindSpore tensor of one element
    (the functional `value_and_grad` style hands the loss over as a Tensor)."""
    if x is None:
        return None
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    if hasattr(x, "asnumpy"):  # a MindSpore tensor
        x = x.asnumpy()
    if hasattr(x, "reshape") and getattr(x, "size", 1) == 1:  # numpy array or scalar of one value
        return float(x.reshape(-1)[0])
    return float(x)


def as_count(x: Any) -> int:
    """A count from the same (NaN, infinities and None: 0)."""
    v = as_number(x)
    return int(v) if v is not None and v == v and abs(v) != float("inf") else 0


def as_flag(x: Any) -> bool | None:
    """A flag from a bool, a number, a numpy scalar or a MindSpore tensor (None stays None)."""
    if x is None:
        return None
    if hasattr(x, "asnumpy"):  # a MindSpore tensor
        x = x.asnumpy()
    if hasattr(x, "reshape") and getattr(x, "size", 1) == 1:
        x = x.reshape(-1)[0]
    return bool(x)


def as_extra(x: Any) -> dict[str, float]:
    """Named scalars (`extra`) as `{name: float}`; a value that is no number is left out."""
    return {str(k): n for k, v in (x or {}).items() if (n := as_number(v)) is not None}

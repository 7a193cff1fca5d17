"""Units the planning modules share: compute dtypes' itemsizes and how bytes and seconds are printed."""

from __future__ import annotations

from lohan.plan.records import P16_ITEMSIZE

GiB = 2**30


def itemsize(compute_dtype: str) -> int:
    """Bytes per element of `compute_dtype`; ValueError naming the choices for any other name."""
    if compute_dtype not in P16_ITEMSIZE:
        raise ValueError(f"compute_dtype={compute_dtype!r}: choose one of {', '.join(sorted(P16_ITEMSIZE))}")
    return P16_ITEMSIZE[compute_dtype]


def gb(n: float) -> str:
    """Bytes in (decimal) GB, as plans and capacity reports print them."""
    return f"{n / 1e9:.2f} GB"


def secs(t: float) -> str:
    """Seconds, four significant digits (whole seconds from 10,000 on)."""
    return f"{t:.4g}s" if t < 1e4 else f"{t:,.0f}s"

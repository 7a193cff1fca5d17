"""Alignment and sizes, without torch: the one definition of the 4 KiB unit every record, buffer and transfer is
padded to, importable by the planning layer (`lohan.plan`), which prices buffers before torch is loaded."""

from __future__ import annotations

# O_DIRECT needs buffer address, file offset and length aligned to the logical block size
# (512 B on most NVMe, 4 KiB on 4Kn drives). 4 KiB satisfies both and equals the page size.
ALIGN = 4096


def is_aligned(value: int, align: int = ALIGN) -> bool:
    return value % align == 0


def align_down(value: int, align: int = ALIGN) -> int:
    return value - value % align


def align_up(value: int, align: int = ALIGN) -> int:
    return -(-value // align) * align


def size_text(n: float) -> str:
    """Bytes for a message, in the unit that shows them (a 6 MiB disk is not '0.01 GiB')."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"

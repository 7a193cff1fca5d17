"""Values a setting is written in: sizes with units (:func:`parse_bytes`), store names, shares of a run's steps."""

from __future__ import annotations

import math
import re


def is_int(value: object) -> bool:
    # bool is a subclass of int; `n_layer=True` is a bug, not a 1-layer model.
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite(value: object) -> bool:
    """A real number that is neither NaN nor infinite (bool excluded, as in `is_int`)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


_STORE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_VOLUME_TAILS = ("-act", "-grad", "-probe")
"""The run's scratch volumes are ``<name>-act`` and so on (lohan.store.files.VOLUMES): a store named like one of them
would share its files with another store's scratch volume in the same directory."""


def store_name_problem(name: object) -> str | None:
    """Why `name` cannot name a store (None if it can). The store's files are ``<nvme>/<name><suffix>``, so the name
    must be a plain file name: a ``/``, ``..`` or an empty name would put them outside the directories the run
    checks and locks (or name them ``None.slab``)."""
    fix = "a store name is a file name: letters, digits, '_' and '-', 1 to 64 characters, e.g. lohan or run-2"
    if not isinstance(name, str) or not _STORE_NAME.fullmatch(name):
        return f"name={name!r}: {fix}"
    if name.endswith(_VOLUME_TAILS):
        return (f"name={name!r}: names ending in {', '.join(_VOLUME_TAILS)} are the scratch volumes of other stores "
                "in the same directory; choose another")
    return None


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | str) -> int:
    """Parse a size such as ``8GiB``, ``512 MiB``, ``2e9`` or ``1073741824`` into bytes.

    GiB/MiB are powers of two, GB/MB powers of ten (STYLE: GiB != GB).

    Raises:
        ValueError: Not a size, not finite (``1e400GiB``), or below zero (``-5GiB`` was once taken as a budget).
    """
    size = None
    if is_int(value):
        size = int(value)
    elif isinstance(value, float) and value.is_integer():
        size = int(value)
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(num):]
        if unit in _BYTE_UNITS and num:
            try:
                scaled = float(num) * _BYTE_UNITS[unit]
            except ValueError:
                scaled = math.nan
            size = int(scaled) if math.isfinite(scaled) else None
    if size is None:
        raise ValueError(f"cannot read {value!r} as a size; write e.g. 8GiB, 512MiB or a number of bytes")
    if size < 0:
        raise ValueError(f"{value!r} is below zero: a size is 0 or more; write e.g. 8GiB, 512MiB or a number of bytes")
    return size


SIZE_FIELDS = ("cpu_mem", "act_mem", "gpu_mem", "stripe_bytes", "opt_chunk_bytes", "resident_mem",
               "readahead_mem")
"""EngineConfig fields that hold byte sizes (a user writes them with a unit: `8GiB`)."""


def unitless_size_problems(engine: dict) -> list[str]:
    """Sizes a user gave as bare numbers (flags, YAML, --set): `--cpu-mem 4` would mean 4 bytes, which nobody
    means. 0 needs no unit. The Python API takes ints as bytes; this is for what a person typed."""
    problems = []
    for name in SIZE_FIELDS:
        value = engine.get(name)
        bare = (isinstance(value, int | float) and not isinstance(value, bool)) or (
            isinstance(value, str) and value.strip().replace(".", "", 1).isdigit())
        if bare and float(value) > 0:  # (a negative size is refused as one by parse_bytes)
            problems.append(f"{name}={value!r}: a size needs a unit; write e.g. {value}GiB, {value}MiB or {value}B "
                            "(bytes)")
    return problems


def steps_share(ratio: float, steps: int) -> int:
    """`ratio` of `steps`, rounded up: 0.07 of 100 is 7 (float arithmetic makes the product 7.000000000000001,
    which a plain ceil would make 8)."""
    return math.ceil(ratio * steps - 1e-9)

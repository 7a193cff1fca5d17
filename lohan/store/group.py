"""The commit record of a data-parallel group (`<name>.dp.json` beside rank 0's store): the step every rank
has committed and the world size. Each rank keeps its store in `<nvme>/rank<r>` (runtime/parallel.py)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from lohan.store.integrity import read_json_checked

_FIX_DECISION = ("The group's commit record cannot be trusted; restore the directories from a backup, or start "
                 "over with --overwrite")


def rank_dir(base: str, rank: int) -> str:
    return os.path.join(base, f"rank{rank}")


def decision_path(base_dirs: Sequence[str], name: str) -> str:
    """Where rank 0 keeps the group's commit decision: beside rank 0's store."""
    return os.path.join(rank_dir(base_dirs[0], 0), f"{name}.dp.json")


def read_decision(base_dirs: Sequence[str], name: str) -> dict | None:
    """The group's last committed step and world size (None: no data-parallel store there)."""
    path = decision_path(base_dirs, name)
    if not os.path.exists(path):
        return None
    data = read_json_checked(path, "data-parallel commit record", _FIX_DECISION, {"world": int, "step": int})
    return {"world": data["world"], "step": data["step"]}

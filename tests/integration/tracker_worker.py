"""A run's trackers killed (SIGKILL) at a chosen point, for tests/integration/test_tracker_resume.py.

`python tracker_worker.py LOGGING_DIR RUN_ID NAMES KILL N`: opens the trackers NAMES (comma-separated) for
RUN_ID in LOGGING_DIR and kills itself at
- `create N`: the N-th SQL statement of the process (inside the creation of MLflow's local store);
- `raw-create N`: the same, but MLflow's own SqlAlchemyStore building `LOGGING_DIR/mlflow/mlflow.db` in place
  (the half-built store a kill of an older lohan left);
- `log N`: inside step N's MLflow transaction (its metrics inserted, not committed), steps 1..N-1 logged, and
  step N logged to the trackers before mlflow in NAMES.
The records are `records(steps)`, which the test logs again on resume.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from lohan.app.metrics import StepMetrics


def records(steps: int) -> list[StepMetrics]:
    """Step records of a run: an evaluation every 2 steps (so the steps' scalars differ), loss going down."""
    return [StepMetrics.from_counters(step=s, loss=3.0 - 0.1 * s, lr=1e-3, tokens=256, step_s=0.5, flops=1e12,
                                      ssd_read_bytes=10**8, lanes={"gpu": 0.2, "ssd_read": 0.1},
                                      grad_norm=1.0 + s, clip_coef=1.0,
                                      eval_loss=2.5 - 0.1 * s if s % 2 == 0 else None,
                                      eval_s=0.05 if s % 2 == 0 else None)
            for s in range(1, steps + 1)]


def _kill_on(statement_matches, after: int) -> dict:
    """SIGKILL this process once `after` SQL statements for which `statement_matches` holds have run."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    state = {"armed": True, "seen": 0}

    @event.listens_for(Engine, "after_cursor_execute")
    def _count(conn, cursor, statement, parameters, context, executemany) -> None:
        if state["armed"] and statement_matches(statement):
            state["seen"] += 1
            if state["seen"] >= after:
                os.kill(os.getpid(), signal.SIGKILL)

    return state


def main(logging_dir: str, run_id: str, names: str, kill: str, n: int) -> None:
    from lohan.app.tracking import Trackers

    if kill == "raw-create":
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        _kill_on(lambda s: True, n)
        db = Path(logging_dir) / "mlflow" / "mlflow.db"
        db.parent.mkdir(parents=True)
        SqlAlchemyStore(f"sqlite:///{db}", (db.parent / "artifacts").as_uri())
        sys.exit("not killed")
    if kill == "create":
        _kill_on(lambda s: True, n)
        Trackers(names.split(","), logging_dir, "lohan")  # no run id: the store's creation is the point
        sys.exit("not killed")
    state = _kill_on(lambda s: s.lstrip().upper().startswith("INSERT INTO METRICS"), 1)
    state["armed"] = False
    trackers = Trackers(names.split(","), logging_dir, "lohan", {"lr": 1e-3}, run_id=run_id)
    for m in records(n):
        state["armed"] = m.step == n
        trackers.log(m)
    sys.exit("not killed")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))

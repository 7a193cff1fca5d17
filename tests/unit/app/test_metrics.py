"""Step metrics: units, the fixed-width line, the JSONL file, the run summary, the progress bar."""

from __future__ import annotations

import dataclasses
import io
import json
import math

import pytest
from rich.console import Console

from lohan.app.metrics import GB, GIB, IDLE_LANES, MetricsWriter, StepMetrics, load_metrics, overlap_percent
from lohan.app.ownership import ForeignFileError
from lohan.app.report import RunSummary, format_step_line, format_summary, progress_bar, report_step


def _m(step: int = 1, **overrides) -> StepMetrics:
    values = dict(
        step=step,
        loss=3.4521,
        lr=2e-4,
        tokens=1024,
        step_s=1.0,
        tokens_per_s=1024.0,
        tflops=0.012,
        ssd_read_gbps=1.23,
        ssd_write_gbps=0.98,
        overlap_pct=87.0,
        cpu_mem_gib=3.2,
    )
    values.update(overrides)
    return StepMetrics(**values)


def test_from_counters_converts_units():
    m = StepMetrics.from_counters(
        step=3,
        loss=2.5,
        lr=1e-3,
        tokens=4096,
        step_s=2.0,
        flops=6e12,
        ssd_read_bytes=4 * GB,
        ssd_write_bytes=GB,
        cpu_mem_bytes=3 * GIB,
        gpu_mem_bytes=GIB // 2,
        lanes={"gpu": 1.5, "ssd": 1.0, "ssd_read": 0.7, "param_wait": 0.3},
    )
    assert m.tokens_per_s == 2048.0
    assert m.tflops == pytest.approx(3.0)
    assert (m.ssd_read_gbps, m.ssd_write_gbps) == (2.0, 0.5)
    assert (m.cpu_mem_gib, m.gpu_mem_gib) == (3.0, 0.5)
    # lanes 1.5 + 1.0 = 2.5 s serial, 1.5 s perfectly overlapped, 2.0 s measured -> half hidden (ssd_read is a
    # part of ssd, param_wait a wait: neither counts).
    assert m.overlap_pct == pytest.approx(50.0)
    with pytest.raises(ValueError, match="step_s=0"):
        StepMetrics.from_counters(step=1, loss=1.0, lr=1.0, tokens=1, step_s=0)


def test_idle_lanes_are_the_engines_waiting_lanes(make_dirs):
    """The waiting lanes left out of the overlap are named as the engine records them: ``param_wait`` in one
    process (``gather`` and ``reduce_wait`` with data parallelism, see tests/integration/test_parallel.py)."""
    import lohan
    from tests.integration.test_engine_equivalence import batches, engine_config, tiny_cfg

    with lohan.init(tiny_cfg(n_layer=2), engine_config(make_dirs(1))) as engine:
        engine.step(next(batches(1, 2, 16, 256)))
        lanes = engine.last_stats.lanes
    assert set(IDLE_LANES) - {"gather", "reduce_wait"} <= set(lanes)
    work = {name: t for name, t in lanes.items() if name not in IDLE_LANES}
    waits = dict(work, param_wait=lanes["param_wait"] + 5.0)  # waiting longer is not more overlap
    assert overlap_percent(waits, 2.0) == overlap_percent(work, 2.0)


def test_overlap_percent_bounds():
    lanes = {"gpu": 2.0, "ssd": 1.0, "cpu": 1.0}
    assert overlap_percent(lanes, 4.0) == 0.0  # serial
    assert overlap_percent(lanes, 2.0) == 100.0  # everything hidden behind compute
    assert overlap_percent(lanes, 3.0) == pytest.approx(50.0)
    assert overlap_percent({"gpu": 2.0}, 2.0) == 0.0  # nothing to overlap
    # an older lohan's names (a metrics file written before the lanes were the cost model's) count the same
    assert overlap_percent({"compute": 2.0, "ssd_read": 1.0, "cpu_adam": 1.0}, 3.0) == pytest.approx(50.0)


def test_to_dict_is_json_safe_and_rounded():
    d = _m(loss=float("nan"), lr=1 / 3, gpu_mem_gib=None, lanes={"gpu": 0.123456789}).to_dict()
    text = json.dumps(d, allow_nan=False)  # raises on NaN if not converted
    back = json.loads(text)
    assert back["loss"] == "NaN" and math.isnan(float(back["loss"]))
    assert back["lr"] == 0.333333 and back["lanes"] == {"gpu": 0.123457}
    assert back["gpu_mem_gib"] is None and back["step"] == 1


def test_step_line_content_and_units():
    line = format_step_line(_m(step=12, tokens_per_s=1234.0), total_steps=200)
    assert line.startswith("step   12/200 | loss  3.4521 | lr 2.00e-04 |     1,234 tok/s")
    for piece in ("0.012 TFLOPS", "SSD r  1.23 w  0.98 GB/s", "overlap  87%", "RAM   3.2 GiB", "1.000 s"):
        assert piece in line
    assert "GPU" not in line
    assert "GPU  10.5 GiB" in format_step_line(_m(gpu_mem_gib=10.5), 200)


@pytest.mark.parametrize("gpu", [None, 12.0])
def test_step_line_width_is_stable_across_very_different_values(gpu):
    extremes = [
        _m(step=1, gpu_mem_gib=gpu),
        _m(
            step=200,
            loss=0.0001,
            lr=0.0,
            tokens_per_s=0.4,
            tflops=0.0,
            ssd_read_gbps=0.0,
            ssd_write_gbps=0.0,
            overlap_pct=0.0,
            cpu_mem_gib=0.01,
            step_s=0.001,
            gpu_mem_gib=gpu,
        ),
        _m(
            step=57,
            loss=123456.789,
            lr=1.0,
            tokens_per_s=98_765_432.1,
            tflops=1234.5678,
            ssd_read_gbps=123.456,
            ssd_write_gbps=99.999,
            overlap_pct=100.0,
            cpu_mem_gib=1536.0,
            step_s=98765.4,
            gpu_mem_gib=None if gpu is None else 141.0,
        ),
        _m(step=100, loss=float("nan"), tokens_per_s=float("inf"), gpu_mem_gib=gpu),
    ]
    lines = [format_step_line(m, total_steps=200) for m in extremes]
    assert len({len(line) for line in lines}) == 1, "\n".join(lines)
    # Columns line up: every separator is at the same offset.
    assert len({tuple(i for i, c in enumerate(line) if c == "|") for line in lines}) == 1
    open_ended = [format_step_line(m) for m in extremes]
    assert len({len(line) for line in open_ended}) == 1


def test_metrics_writer_appends_parseable_jsonl(tmp_path):
    path = tmp_path / "run" / "nested" / "metrics.jsonl"
    with MetricsWriter(path, "run-a") as w:
        assert not path.exists()  # created with its first record, never empty
        w.write(_m(step=1, loss=3.0))
        w.write(_m(step=2, loss=float("inf")))
        # Flushed per line: readable while the writer is still open.
        assert len(path.read_text().splitlines()) == 2
    with MetricsWriter(path, "run-a") as w:  # resuming appends, it does not truncate
        assert w.last_step == 2
        w.write(_m(step=3, loss=2.0))
    records = load_metrics(path)
    for line in path.read_text().splitlines():
        json.loads(line)
    assert [r.get("step") for r in records] == [1, 2, 3]
    assert [r.get("loss") for r in records] == [3.0, "Infinity", 2.0]
    assert {r["run_id"] for r in records} == {"run-a"}  # every record says whose it is
    assert StepMetrics.from_record(records[1]).loss == float("inf")
    with pytest.raises(ValueError, match="closed"):
        w.write(_m())


def test_metrics_writer_cuts_back_to_the_committed_steps_and_refuses_other_files(tmp_path):
    """A resume after a kill: the records of steps past the committed one and a line cut short go; another run's
    file, a user's JSONL (even one whose records have a step) and an empty file are never written to."""
    path = tmp_path / "m.jsonl"
    with MetricsWriter(path, "run-a") as w:
        for step in (1, 2, 3):
            w.write(_m(step=step, loss=1.0))
    with path.open("a") as f:
        f.write('{"step": 4, "loss"')  # a kill in the middle of a line
    with MetricsWriter(path, "run-a", through=2) as w:
        assert w.last_step == 2
        w.write(_m(step=3, loss=1.5))
    assert [(r["step"], r["loss"]) for r in load_metrics(path)] == [(1, 1.0), (2, 1.0), (3, 1.5)]
    with pytest.raises(ForeignFileError, match="the metrics of another run"):
        MetricsWriter(path, "run-b")
    user = tmp_path / "my_training_log.jsonl"
    user.write_text("".join(json.dumps({"step": i, "loss": 1.0}) + "\n" for i in range(100)))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for foreign in (user, empty):
        before = foreign.read_bytes()
        with pytest.raises(ForeignFileError, match="a file lohan did not write"):
            MetricsWriter(foreign, "run-a")
        assert foreign.read_bytes() == before
    w = MetricsWriter(tmp_path / "new.jsonl", "run-a")
    (tmp_path / "new.jsonl").write_text("a user's file, made after the run started\n")
    with pytest.raises(ForeignFileError, match="appeared"):
        w.write(_m(step=1))
    assert (tmp_path / "new.jsonl").read_text() == "a user's file, made after the run started\n"
    assert not list(tmp_path.glob(".*.tmp"))


def test_summary_numbers_from_known_inputs():
    steps = [
        # warm-up step: slow, excluded from the means
        _m(
            step=1,
            loss=5.0,
            tokens=1000,
            step_s=10.0,
            tflops=0.1,
            ssd_read_gbps=0.1,
            ssd_write_gbps=0.1,
            overlap_pct=0.0,
            cpu_mem_gib=2.0,
        ),
        _m(
            step=2,
            loss=4.0,
            tokens=1000,
            step_s=1.0,
            tflops=1.0,
            ssd_read_gbps=2.0,
            ssd_write_gbps=1.0,
            overlap_pct=50.0,
            cpu_mem_gib=4.0,
        ),
        _m(
            step=3,
            loss=float("nan"),
            tokens=1000,
            step_s=3.0,
            tflops=2.0,
            ssd_read_gbps=4.0,
            ssd_write_gbps=3.0,
            overlap_pct=90.0,
            cpu_mem_gib=3.0,
        ),
        _m(
            step=4,
            loss=4.5,
            tokens=1000,
            step_s=1.0,
            tflops=1.0,
            ssd_read_gbps=2.0,
            ssd_write_gbps=1.0,
            overlap_pct=70.0,
            cpu_mem_gib=3.0,
        ),
    ]
    s = RunSummary.from_steps(steps)
    assert (s.steps, s.measured_steps) == (4, 3)
    assert (s.first_loss, s.last_loss, s.min_loss, s.min_loss_step) == (5.0, 4.5, 4.0, 2)
    assert s.total_s == 15.0 and s.total_tokens == 4000
    assert s.tokens_per_s == pytest.approx(3000 / 5.0)  # steps 2-4: 3000 tokens in 5 s
    assert s.tflops == pytest.approx((1 + 6 + 1) / 5.0)  # time-weighted
    assert s.ssd_read_gbps == pytest.approx((2 + 12 + 2) / 5.0)
    assert s.ssd_write_gbps == pytest.approx((1 + 9 + 1) / 5.0)
    assert s.overlap_pct == pytest.approx((50 + 270 + 70) / 5.0)
    assert s.peak_cpu_mem_gib == 4.0 and s.peak_gpu_mem_gib is None
    json.dumps(s.to_dict(), allow_nan=False)

    text = format_summary(steps)
    assert "4 steps, 4,000 tokens in 15.0 s (0:00:15)" in text
    assert "first 5.0000" in text and "last 4.5000" in text and "min 4.0000 (step 2)" in text
    assert (
        "600 tok/s" in text and "1.600 TFLOPS" in text and "(mean over 3 steps, 1 warm-up excluded)" in text
    )
    assert "read 3.20 GB/s" in text and "write 2.20 GB/s" in text and "overlap 78%" in text

    single = RunSummary.from_steps(steps[:1])  # nothing left after warm-up: use the only step
    assert single.measured_steps == 1 and single.tokens_per_s == 100.0
    with pytest.raises(ValueError, match="no steps"):
        RunSummary.from_steps([])


def test_progress_bar_prints_step_lines_when_not_a_terminal():
    out = io.StringIO()
    console = Console(file=out, width=120)  # a file: not a terminal, like CI
    assert not console.is_terminal
    progress = progress_bar(3, console=console)
    lines = []
    with progress:
        for step in (1, 2, 3):
            lines.append(report_step(progress, _m(step=step, loss=4.0 - step), total_steps=3))
    text = out.getvalue()
    for line in lines:
        assert line in text  # printed whole, not wrapped or styled
    assert progress.tasks[0].completed == 3
    assert "loss 1.0000" in text  # the final bar shows the last loss


def test_log_lines_fit_120_columns_and_carry_elapsed_and_eta():
    from lohan.app.report import LOG_LINE_WIDTH, format_eval_line, format_log_line

    m = _m(step=123_456, loss=10.12345)
    line = format_log_line(m, 1_000_000, elapsed_s=3_600 * 99 + 59, eta_s=3_600 * 99)
    assert len(line) <= LOG_LINE_WIDTH and line.startswith("step  123456/1000000 | loss 10.1235")
    assert line.endswith("99:00:59<99:00:00") and "GB/s" in line and "tok/s" in line
    m = dataclasses.replace(m, grad_norm=12.5, clip_coef=0.08)
    huge = format_log_line(m, 10**9, elapsed_s=3_600 * 9_999, eta_s=3_600 * 99_999)
    assert len(huge) <= LOG_LINE_WIDTH and "tok/s" not in huge and "gnorm 12.500c" in huge  # throughput gives way
    assert format_log_line(_m(step=1), 10, 1.0, None).endswith("0:00:01<-:--:--")  # no ETA before a rate
    evaluated = dataclasses.replace(_m(step=5), eval_loss=2.0, eval_ppl=math.exp(2.0), eval_s=0.5)
    assert format_eval_line(evaluated) == "  eval after step 5: loss 2.0000 | ppl 7.39 | 0.50 s"


def test_log_every_defaults_and_which_steps_get_a_line():
    from lohan.app.report import default_log_every, should_log

    assert default_log_every(10_000, terminal=True) == 1
    assert default_log_every(150, terminal=False) == 1
    assert default_log_every(10_000, terminal=False) == 50 and default_log_every(1_000_000, terminal=False) == 5000
    for total in (201, 999, 12_345, 10**7):  # about 200 lines, never more
        assert 100 <= total / default_log_every(total, terminal=False) <= 201
    got = [s for s in range(11, 31) if should_log(s, 30, every=10, first=11, evaluated=s == 17)]
    assert got == [11, 17, 20, 30]  # a resumed run's first step, an evaluating step, every 10th, the last


def test_a_log_file_gets_the_short_line_and_the_bar_only_moves_between_lines():
    out = io.StringIO()
    console = Console(file=out, width=200)
    progress = progress_bar(4, console=console)
    with progress:
        for step in (1, 2, 3, 4):
            report_step(progress, _m(step=step), total_steps=4, print_line=step in (1, 4))
        assert progress.tasks[0].completed == 4
    lines = [ln for ln in out.getvalue().splitlines() if ln.startswith("step")]
    assert [ln.split("|")[0].strip() for ln in lines] == ["step 1/4", "step 4/4"]
    assert all("<" in ln and "TFLOPS" not in ln for ln in lines)

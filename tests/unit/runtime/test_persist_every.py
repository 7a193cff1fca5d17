"""The durability interval (`engine.persist_every`): with every record resident, the steps between durable ones
write and commit nothing to the SSDs, read their states (the P16 included) from RAM, and train the same bits as
plain PyTorch; every N-th step, `close`, evaluations and exports persist; a failure or a kill goes back to the last
durable step. Where records stream, the interval is 1."""

from __future__ import annotations

import json
import math
import re
import signal
import time

import pytest
import torch

import lohan
from lohan.plan.durability import eligible, loss_text, persist_interval
from lohan.runtime.held import finish_before_interrupts
from tests.unit.runtime.test_clipping import STEPS, batches, check, reference, same_weights, tiny_cfg
from tests.unit.runtime.test_clipping import config as _config


def config(dirs, **kw):
    return _config(dirs, **{"resident_mem": "all", **kw})


def _commit(dirs) -> dict:
    return json.loads(open(f"{dirs[0]}/lohan.commit.json").read())


@pytest.mark.parametrize("clip", [1.5, 0.0])
@pytest.mark.parametrize("lookahead", [False, True])
def test_an_interval_trains_the_same_bits_as_pytorch(make_dirs, clip, lookahead):
    metrics = check(tiny_cfg(), config(make_dirs(1), persist_every=3, max_grad_norm=clip), lookahead=lookahead)
    assert [m["durable"] for m in metrics] == [(s + 1) % 3 == 0 for s in range(STEPS)]
    # (a held step that clips may have speculated: clip_mode auto weighs the replay from the last durable commit it
    # then costs, `test_a_speculated_step_held_in_ram_that_clips_is_replayed_at_its_coefficient`; the bits are equal)


@pytest.mark.parametrize("lookahead", [False, True])
def test_clipping_off_steps_held_in_ram_update_them_in_place_during_backward(make_dirs, lookahead):
    """Clipping off, the update of a step whose states are in RAM only runs during backward (active gradient
    offloading, as on the SSDs), in place: the same bits as PyTorch."""
    ecfg = config(make_dirs(1), persist_every=3, max_grad_norm=0.0, clip_mode="speculate")
    metrics = check(tiny_cfg(), ecfg, lookahead=lookahead)
    assert [m["deferred"] for m in metrics] == [False] * STEPS
    assert [m["durable"] for m in metrics] == [(s + 1) % 3 == 0 for s in range(STEPS)]
    # with the next batch known, the blocks still to update once backward ends go in forward order and the next
    # forward follows them (the last step has no next batch)
    assert [m["next_forward_overlapped"] for m in metrics] == [
        lookahead and not m["durable"] and s + 1 < STEPS for s, m in enumerate(metrics)]


@pytest.mark.parametrize("handover", [True, False])
def test_once_backward_ends_the_blocks_left_update_in_forward_order_and_the_next_forward_follows(make_dirs,
                                                                                                 monkeypatch, handover):
    """A slow optimizer (each block's update held 30 ms) is still updating when backward ends: the blocks it has not
    begun go in forward order, each handed to the next step's forward as it is done, so that forward starts at
    block 0 while the pass still runs instead of after the whole pass. The blocks updated during backward reach that
    forward kept from the hand-over, or (`handover` False: no room) from their records, this step's update. The same
    bits as PyTorch."""
    from lohan.runtime import offload, params

    if not handover:
        monkeypatch.setattr(params.ParamStreamer, "handover", lambda self, old, new: None)

    events = []
    update, acquire = offload.UpdatePass._update, params.ParamStreamer.acquire

    def slow_update(self, rb, grad):
        time.sleep(0.03)
        events.append(("update", rb.unit[0], rb.unit[1], time.perf_counter()))
        return update(self, rb, grad)

    def logged_acquire(self, i, slot):
        events.append(("acquire", i, slot, time.perf_counter()))
        return acquire(self, i, slot)

    monkeypatch.setattr(offload.UpdatePass, "_update", slow_update)
    monkeypatch.setattr(params.ParamStreamer, "acquire", logged_acquire)
    ecfg = config(make_dirs(1), persist_every=3, max_grad_norm=0.0, clip_mode="speculate")
    metrics = check(tiny_cfg(), ecfg, lookahead=True)
    assert metrics[0]["next_forward_overlapped"] and not metrics[0]["durable"]
    # that forward's waits for the pass are the optimizer's (provision_wait), not waits for P16 being read
    assert metrics[0]["lanes"]["provision_wait"] > 0.02 > metrics[0]["lanes"]["param_wait"], metrics[0]["lanes"]
    # step 1's updates: backward order while gradients come, then forward order for the rest
    n = len({e[1] for e in events if e[0] == "update"})
    first = [e[1] for e in events if e[0] == "update" and e[2] == 0][:n]
    j = first.index(0)  # where the tail in forward order begins
    assert first[:j] == sorted(first[:j], reverse=True) and first[j:] == sorted(first[j:]), first
    assert n - j >= 2, first  # blocks were left to the tail and reordered (backward order ends at block 0)
    # the next forward acquired block 0 before the pass's last update
    last_update = [e[3] for e in events if e[0] == "update"][n - 1]
    t_block0 = [e[3] for e in events if e[0] == "acquire" and e[1] == 0]
    assert t_block0[1] < last_update, (t_block0, last_update)


def test_a_speculated_step_held_in_ram_that_clips_is_replayed_at_its_coefficient(make_dirs, caplog):
    """Clipping on and speculated: a step whose states are in RAM only updates them in place during backward at
    coefficient 1; where it clips after all, there is no previous slot to redo from, so the steps since the last
    durable commit are replayed from their batches and the step runs again at the coefficient it is now known to
    take. The same bits as PyTorch's clip_grad_norm_ + AdamW."""
    ecfg = config(make_dirs(1), persist_every=3, max_grad_norm=1.0, clip_mode="speculate")
    metrics = check(tiny_cfg(), ecfg)
    held = [m for m in metrics if not m["durable"]]
    assert not any(m["deferred"] for m in held)
    assert any(m["clip_coef"] < 1 for m in held)  # (the data clips: what this test is about)
    assert "clips (coefficient" in caplog.text and "replaying 1 step(s)" in caplog.text


def run_poisoned(mcfg, ecfg, data, poison):
    """The engine on `data`, the steps in `poison` made not finite by their batch, not by the call (the replayed
    steps run inside the failed step's call): losses, metrics, final weights."""
    bad = [data[s][0] for s in poison]
    losses, metrics = [], []
    with lohan.init(mcfg, ecfg) as engine:
        real = engine.program.run
        engine.program.run = lambda i, x, t: (real(i, x, t) * math.nan if i == 0 and any(torch.equal(x.cpu(), b)
                                              for b in bad) else real(i, x, t))
        for batch in data:
            losses.append(engine.step(batch))
            metrics.append(engine.last_stats.to_dict())
        return losses, metrics, engine.state_dict_fp32()


def test_a_replay_runs_each_held_step_as_it_ended_and_none_replays_again(make_dirs, caplog):
    """Held steps that clipped or were skipped are replayed as they ended (at their coefficient, skipped), so a
    replay never triggers another: one replay per step that failed in place, and PyTorch's bits."""
    mcfg = tiny_cfg()
    ecfg = config(make_dirs(1), persist_every=STEPS, max_grad_norm=1.0, clip_mode="speculate")
    data, poison = list(batches(STEPS)), {3, 5}
    losses, metrics, params = run_poisoned(mcfg, ecfg, data, poison)
    ref_losses, _, ref_params = reference(mcfg, ecfg, data, poison)
    assert [str(x) for x in losses] == [str(x) for x in ref_losses]
    failed = [s for s, m in enumerate(metrics) if s and (m["skipped"] or m["clip_coef"] < 1)]  # (step 0 reads SSDs)
    assert len(failed) >= 3 and caplog.text.count("replaying") == len(failed)
    same_weights(params, ref_params)


def test_a_non_finite_step_that_updated_ram_in_place_is_replayed_and_skipped(make_dirs, caplog):
    """A step that updated RAM-only states in place and then turned out not finite: the engine goes back to the
    last durable commit, replays the steps since from their batches and skips the failed one, the same bits as
    PyTorch's guarded loop. (Step 4 is the first after a durable one: it reads the SSD slot, and skips as usual.)"""
    mcfg = tiny_cfg()
    ecfg = config(make_dirs(1), persist_every=4, max_grad_norm=0.0, clip_mode="speculate")
    data, poison = list(batches(STEPS)), {4, 6}
    losses, metrics, params = run_poisoned(mcfg, ecfg, data, poison)
    ref_losses, ref_norms, ref_params = reference(mcfg, ecfg, data, poison)
    assert [str(x) for x in losses] == [str(x) for x in ref_losses]
    assert [m["skipped"] for m in metrics] == [s in poison for s in range(STEPS)]
    assert "replaying 1 step(s)" in caplog.text
    same_weights(params, ref_params)


CHUNKED = {"opt_chunk_bytes": "1MiB"}
"""With `tiny_cfg(vocab_size=4096)`: the embedding's record (264192 elements) is updated in five chunks."""


@pytest.mark.parametrize("clip", [1.5, 0.0])
@pytest.mark.parametrize("every", [1, 3])
def test_an_interval_with_a_record_updated_in_chunks_trains_the_same_bits_as_pytorch(make_dirs, clip, every):
    """A block updated in chunks stays resident (one buffer per chunk), so the interval applies: its chunks' READs
    are skipped, their P16 served from RAM between durable steps, their WRITEs made at durable ones."""
    mcfg, ecfg = tiny_cfg(vocab_size=4096), config(make_dirs(1), persist_every=every, max_grad_norm=clip, **CHUNKED)
    with lohan.init(mcfg, ecfg) as engine:
        assert engine.layout.blocks[0].numel > engine.store.chunk_elems  # (updated in chunks)
        assert engine.offloader.resident == [0, 1, 2, 3] and engine.persist_refusal is None
        # the CPU computes on the records of the others in place, and loads them before the first step's pass
        zero = engine.run_plan.zero_copy
        assert zero == ((1, 2, 3) if engine.device.is_host else ())
    metrics = check(mcfg, ecfg.with_overrides(nvme=tuple(make_dirs(1, "run"))), lookahead=True)
    assert [m["durable"] for m in metrics] == [(s + 1) % every == 0 for s in range(STEPS)]
    assert [m["resident_record_hits"] for m in metrics] == [len(zero)] + [4] * (STEPS - 1)


@pytest.mark.parametrize("chunked", [False, True])
def test_steps_between_durable_ones_write_nothing(make_dirs, chunked):
    dirs = make_dirs(1)
    data = list(batches(STEPS))
    mcfg = tiny_cfg(vocab_size=4096) if chunked else tiny_cfg()
    with lohan.init(mcfg, config(dirs, persist_every=4, write_behind=False, **(CHUNKED if chunked else {}))) as engine:
        assert engine.persist_every == 4 and engine.persist_refusal is None
        assert (engine.layout.blocks[0].numel > engine.store.chunk_elems) == chunked
        slot_bytes = engine.store.layout.slot_bytes
        for step, batch in enumerate(data[:6]):
            engine.step(batch)
            stats = engine.last_stats
            if (step + 1) % 4:
                assert stats.ssd_write_bytes == 0 and not stats.durable, step
                assert engine.committed_step == 4 * ((step + 1) // 4)  # the last durable step, on disk too
                assert _commit(dirs)["step"] == engine.committed_step
            else:
                assert stats.ssd_write_bytes >= slot_bytes and stats.durable
                assert engine.committed_step == step + 1 == _commit(dirs)["step"]
            if step % 4 >= 2:  # a step after one held in RAM: every record and P16 from RAM
                assert stats.ssd_read_bytes == 0, step
        assert engine.step_count == 6 and engine.committed_step == 4
    # close persisted step 6
    assert _commit(dirs)["step"] == 6


@pytest.mark.parametrize("chunked", [False, True])
def test_close_eval_and_reads_persist_first_and_resume_is_exact(make_dirs, chunked):
    """`close`, `evaluate` and `state_dict_fp32` persist the steps held in RAM (a record updated in chunks too, chunk
    by chunk); a reopened store resumes from there bit-identically."""
    mcfg = tiny_cfg(vocab_size=4096) if chunked else tiny_cfg()
    ecfg = config(make_dirs(1), persist_every=5, **(CHUNKED if chunked else {}))
    data = list(batches(STEPS))
    _, _, ref_params = reference(mcfg, ecfg, data)
    with lohan.init(mcfg, ecfg) as engine:
        engine.step(data[0])
        engine.step(data[1])
        assert engine.committed_step == 0
        engine.evaluate(data[2])
        assert engine.committed_step == 2 == _commit(ecfg.nvme)["step"]
        engine.step(data[2])
        assert engine.committed_step == 2
    assert _commit(ecfg.nvme)["step"] == 3
    with lohan.init(mcfg, ecfg, resume=True) as engine:
        assert engine.step_count == 3
        for batch in data[3:]:
            engine.step(batch)
        params = engine.state_dict_fp32()
        assert engine.committed_step == STEPS
    same_weights(params, ref_params)


def test_a_failed_update_between_durable_steps_goes_back_to_the_last_durable_one(make_dirs):
    """An update that fails halfway overwrote states that were only in RAM: the last durable commit is current
    again (what a resume would find), and the engine runs on from it, the same bits as a run that did so."""
    mcfg, ecfg = tiny_cfg(), config(make_dirs(1), persist_every=3, write_behind=False)
    data = list(batches(STEPS))
    with lohan.init(mcfg, ecfg) as engine:
        for batch in data[:4]:
            engine.step(batch)
        assert (engine.step_count, engine.committed_step) == (4, 3)
        real, calls = engine.offloader._pass.__class__._update, []

        def failing(self, rb, grad):
            calls.append(rb.unit)
            if len(calls) == 2:
                raise OSError("injected")
            return real(self, rb, grad)
        engine.offloader._pass.__class__._update = failing
        try:
            with pytest.raises(RuntimeError):
                engine.step(data[4])
        finally:
            engine.offloader._pass.__class__._update = real
        assert (engine.step_count, engine.committed_step) == (3, 3)
        for batch in data[3:]:
            engine.step(batch)
        params = engine.state_dict_fp32()
    _, _, ref_params = reference(mcfg, ecfg, data)
    same_weights(params, ref_params)


def test_streamed_records_keep_the_interval_at_one(make_dirs):
    """Records streamed from the SSDs are written every step: an explicit interval is lowered to 1 (said why), and
    auto is 1."""
    dirs = make_dirs(1)
    for every in (4, "auto"):
        ecfg = config(dirs, persist_every=every, resident_records=False, resident_mem=0)
        with lohan.init(tiny_cfg(), ecfg, overwrite=True) as engine:
            assert engine.persist_every == 1
            assert "stream" in engine.persist_refusal
            engine.step(next(batches(1)))
            assert engine.last_stats.durable and engine.committed_step == 1


def test_auto_prices_the_interval_from_the_writes():
    # 1.75 GB of records at 2 GB/s against a 2.74 s step: 0.875 s / (0.1 * 2.74 s) -> 4 steps
    assert persist_interval(1_750_000_000, 2e9, 2.74) == 4
    assert persist_interval(6_000_000, 2e9, 0.05) == 1  # 3 ms of writes: every step
    assert persist_interval(200_000_000, 2e9, 2.0) == 1  # writes under 10% of a step: every step
    assert persist_interval(14_000_000_000, 2.4e9, 0.5) == 100  # capped (MAX_AUTO)
    assert persist_interval(0, 2e9, 1.0) == 1
    assert eligible(False, 2, True, True).startswith("records stream")
    assert eligible(True, 1, True, True).startswith("slots=1")
    assert eligible(True, 2, True, True) is None
    assert loss_text(4, 30.0) == "a kill loses at most 4 steps, about 2.0 minutes"


def test_auto_with_every_record_resident_follows_the_measured_writes(make_dirs, monkeypatch):
    import lohan.runtime.engine as eng
    monkeypatch.setattr(eng.durability, "persist_interval", lambda *a, **k: 3)
    with lohan.init(tiny_cfg(), config(make_dirs(1), persist_every="auto")) as engine:
        assert engine.persist_every == 1  # nothing measured yet: the first step is durable
        data = list(batches(4))
        engine.step(data[0])
        assert engine.persist_every == 3
        engine.step(data[1])
        assert not engine.last_stats.durable
        torch.manual_seed(0)


def test_the_engines_plan_is_priced_at_the_interval_in_force(make_dirs):
    """The activation plan is made at the first step, before `auto` knows its interval: the engine prices it again at
    the interval in force once it does (a step's share of the writes, the held steps' T_iter), as the schedule reads
    it; the swap set stays."""
    from lohan.plan.planner import estimate

    ecfg = config(make_dirs(1), persist_every=3, max_grad_norm=0.0)
    with lohan.init(tiny_cfg(), ecfg) as engine:
        data = list(batches(3))
        for k, batch in enumerate(data):
            engine.step(batch, next_batch=data[k + 1] if k + 1 < len(data) else None)
        act = engine.activations
        assert act.profile.persist_every == 3
        again = estimate(act.profile, act.plan.swap)
        assert act.plan.estimate.t_iter == again.t_iter and again.traffic == act.plan.estimate.traffic


def test_the_cost_model_and_the_dry_run_price_the_interval(tmp_path, capsys):
    """`planner.capacity(persist_every=)`: with every record resident, a step's record writes are 1/N of a persist's
    (the ssd lane shrinks), `auto` takes the least N that keeps them under a tenth of the step, streamed records keep
    N = 1 and say why; the dry run prints the interval and what a kill loses."""
    from lohan.app.cli import main
    from lohan.config import get_model_config
    from lohan.plan.planner import capacity, parse_hardware

    mcfg, hw = get_model_config("125m", vocab_size=4096), parse_hardware("rtx4090,1xP5510,64GB")
    plans = {pe: capacity(mcfg, hw, 1, 512, "bf16", resident_mem="all", cpu_mem=32 << 30, persist_every=pe)
             for pe in (1, 4, "auto")}
    every, four, auto = plans[1].plan.estimate, plans[4].plan.estimate, plans["auto"].plan.estimate
    states = every.traffic["ssd_write"]
    assert four.traffic["ssd_write"] == pytest.approx(states / 4)
    assert four.lanes_b["ssd"] < every.lanes_b["ssd"]
    n = plans["auto"].persist_every
    assert n == persist_interval(states, hw.bw_m2s, every.t_iter) and n > 1
    assert auto.traffic["ssd_write"] == pytest.approx(states / n)
    streamed = capacity(mcfg, hw, 1, 512, "bf16", resident_mem=0, persist_every=4)
    assert streamed.persist_every == 1 and streamed.persist_note.startswith("records stream")
    assert main(["--model", "tiny", "--data", "synthetic", "--steps", "3", "--nvme", str(tmp_path),
                 "--compute-dtype", "fp32", "--dry-run", "--persist-every", "5",
                 "--set", "engine.resident_mem=all"]) == 0
    out = capsys.readouterr().out
    assert "durability: persist_every 5: the records written every 5 steps; a kill loses at most 5 steps" in out


def test_auto_prices_a_persist_at_the_profiled_write_rate_not_a_steps_window(make_dirs):
    """auto weighs a slot of records at the SSDs' profiled write rate against each step's time without its own
    writes. With write-behind a durable step's writes fall mostly into the next step: a step that measured a sliver
    of them (16 KB) would have priced the writes 100x too slow; before a profile exists, such a step prices nothing."""
    import dataclasses
    from types import SimpleNamespace

    with lohan.init(tiny_cfg(), config(make_dirs(1), persist_every="auto")) as engine:
        slot = engine.store.layout.slot_bytes
        sliver = SimpleNamespace(ssd_write_bytes=16 << 10, step_s=1.0, lanes={"ssd_write": 0.5})
        engine._observe_persist(sliver)  # no profile yet (no step ran): nothing to price the writes with
        assert engine._auto_persist == 1
        engine.step(next(batches(1)))
        profile = engine.activations.profile
        rate = slot / 0.5  # a persist takes 0.5 s
        engine.activations.profile = dataclasses.replace(
            profile, hardware=dataclasses.replace(profile.hardware, bw_m2s=rate))
        engine._observe_persist(sliver)
        assert engine._auto_persist == persist_interval(slot, rate, 0.5) == 10
        engine._observe_persist(SimpleNamespace(ssd_write_bytes=0, step_s=2.0, lanes={"ssd_write": 0.0}))
        assert engine._auto_persist == persist_interval(slot, rate, 2.0) == 3


def test_the_header_says_what_a_kill_loses_in_steps_and_time(tmp_path, capsys):
    """The run's header: the interval in force and what a kill can lose, the time at the pre-flight's predicted
    step (the engine's own estimate exists only once the first step has profiled)."""
    from lohan.app.cli import main

    # (the header's line does not depend on the shape: a short sequence and a small batch keep the steps cheap)
    assert main(["--model", "tiny", "--data", "synthetic", "--steps", "2", "--nvme", str(tmp_path),
                 "--seq-len", "64", "--batch-size", "4",
                 "--compute-dtype", "fp32", "--persist-every", "3", "--set", "engine.resident_mem=all"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "durability:" in ln)
    assert "records written and committed every 3 step(s)" in line
    assert re.search(r"a kill loses at most 3 steps, about [0-9.]+ (s|minutes)", line), line


def interrupted_step(engine, batch) -> None:
    """`engine.step(batch)` with Ctrl-C sent mid-pass, from the optimizer's thread at its second update (the handler
    runs on the main one); the step must raise KeyboardInterrupt."""
    cls = engine.offloader._pass.__class__
    real, calls = cls._update, []

    def interrupted(self, rb, grad):
        calls.append(rb.unit)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGINT)
        return real(self, rb, grad)
    cls._update = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.step(batch)
    finally:
        cls._update = real


def test_ctrl_c_during_a_step_that_updates_ram_in_place_waits_for_its_commit(make_dirs, caplog):
    """Ctrl-C while a step updates RAM-only states in place: the step finishes and commits first, then the interrupt
    is raised, so the driver's persist loses nothing; the run goes on the same bits as PyTorch."""
    mcfg = tiny_cfg()
    ecfg = config(make_dirs(1), persist_every=4, max_grad_norm=0.0, clip_mode="speculate")
    data = list(batches(STEPS))
    with lohan.init(mcfg, ecfg) as engine:
        for batch in data[:5]:
            engine.step(batch)
        interrupted_step(engine, data[5])
        assert "SIGINT: finishing the step first" in caplog.text
        assert (engine.step_count, engine.committed_step) == (6, 4)
        engine.persist()
        assert engine.committed_step == 6
        for batch in data[6:]:
            engine.step(batch)
        params = engine.state_dict_fp32()
    same_weights(params, reference(mcfg, ecfg, data)[2])


def test_a_second_signal_stops_at_once():
    with pytest.raises(KeyboardInterrupt):
        with finish_before_interrupts(True):
            signal.raise_signal(signal.SIGINT)
            held = True  # the first one is held ...
            signal.raise_signal(signal.SIGINT)  # ... the second is not
            held = False
    assert held and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_during_a_step_that_then_replays_is_raised_after_the_replay(make_dirs, caplog):
    """Ctrl-C during a held step that turns out not finite: the replay the step needs runs first (an interrupt
    must not leave it halfway), then the interrupt is raised; nothing is lost."""
    mcfg = tiny_cfg()
    ecfg = config(make_dirs(1), persist_every=STEPS, max_grad_norm=0.0, clip_mode="speculate")
    data = list(batches(STEPS))
    with lohan.init(mcfg, ecfg) as engine:
        for batch in data[:3]:
            engine.step(batch)
        real_run = engine.program.run
        engine.program.run = lambda i, x, t: (real_run(i, x, t) * math.nan if i == 0 and torch.equal(x.cpu(), data[3][0])
                                              else real_run(i, x, t))
        interrupted_step(engine, data[3])
        assert "replaying 3 step(s)" in caplog.text and engine.step_count == 4 and engine.last_stats.skipped
        engine.persist()
        for batch in data[4:]:
            engine.step(batch)
        engine.program.run = real_run
        params = engine.state_dict_fp32()
    same_weights(params, reference(mcfg, ecfg, data, {3})[2])

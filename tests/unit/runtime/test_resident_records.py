"""Resident records: the optimizer records of some blocks stay in the record pool from one step to the next, and
the next step skips their READ. The same bits as plain PyTorch in every way a step can end (committed, skipped,
redone, dropped with its tail, rolled back), fewer bytes read, and the pool's budget unchanged."""

from __future__ import annotations

import re

import pytest

import lohan
from io_engine.base import align_up
from io_engine.faults import inject_faults
from lohan.plan.pools import (
    PoolGeometry,
    chunk_record_bytes,
    plan_host_memory,
    plan_resident,
    record_pool_bytes,
)
from lohan.store.states import BlockLayout, ParamSpec, StoreLayout
from tests.unit.runtime.test_clipping import STEPS, batches, check, reference, same_weights, tiny_cfg
from tests.unit.runtime.test_clipping import config as _config


def config(dirs, **kw):
    """test_clipping's, without the read-ahead room (optimized mode's, `readahead_mem`): these tests size the record
    pool by its resident records."""
    return _config(dirs, **{"readahead_mem": 0, **kw})


@pytest.fixture
def streamed(monkeypatch):
    """The simulated device: a separate device's view of the records, read by the optimizer's pass as it needs them.
    (The CPU computes on them in place, and so loads them between steps: `test_the_host_device_computes_on_...`.)"""
    monkeypatch.setenv("LOHAN_DEVICE", "sim")


def _layout(sizes: list[int]) -> StoreLayout:
    blocks, off = [], 0
    for i, n in enumerate(sizes):
        b = BlockLayout(i, f"block{i}", (ParamSpec("w", (n,), 0, n),), n, 2, off)
        blocks.append(b)
        off += b.record_bytes
    return StoreLayout(tuple(blocks), "bf16", 2)


def _caps(layout: StoreLayout, chosen: list[int]) -> int:
    return sum(align_up(layout.blocks[i].record_bytes) for i in chosen)


def test_the_plan_keeps_the_largest_record_and_the_lowest_blocks_beside_the_streamed_ones():
    # a tied embedding (3.6x a layer), twelve layers, a final norm; the pool holds three embedding records
    layout = _layout([3_600_000] + [1_000_000] * 12 + [4096])
    big, layer, norm = (align_up(layout.blocks[i].record_bytes) for i in (0, 1, 13))
    chosen = plan_resident(layout, 3 * big, 3, chunk_elems=1 << 30)
    # the embedding stays; three layer buffers stream; what is left keeps the lowest layers (and the norm)
    fit, left = divmod(3 * big - big - 3 * layer, layer)
    assert fit == 4
    assert chosen == [0, *range(1, 1 + fit)] + ([13] if left >= norm else [])
    assert _caps(layout, chosen) + 3 * layer <= 3 * big
    # one record in flight: a pool of one embedding record cannot keep anything beside it
    assert plan_resident(layout, big, 1, chunk_elems=1 << 30) == []
    # a pool that holds the whole model keeps all of it
    assert plan_resident(layout, _caps(layout, list(range(14))), 3, chunk_elems=1 << 30) == list(range(14))


def test_the_pool_streams_through_inflight_buffers_beside_the_records_bigger_than_them():
    layout = _layout([3_600_000] + [1_000_000] * 12 + [4096])
    big, layer = (align_up(layout.blocks[i].record_bytes) for i in (0, 1))
    chunk = 1 << 30
    assert record_pool_bytes(layout, 3, chunk, resident=False) == 3 * layout.blocks[0].record_bytes
    pool = record_pool_bytes(layout, 3, chunk, resident=True)
    assert pool == big + 3 * layer < 3 * big  # the embedding takes one buffer, not three
    assert plan_resident(layout, pool, 3, chunk) == [0]  # and the plan keeps it there
    same = _layout([1_000_000] * 4)  # equal records: keeping one gains nothing
    assert record_pool_bytes(same, 3, chunk, resident=True) == 3 * same.blocks[0].record_bytes
    small = _layout([100_000, 50_000])  # less than three buffers in all: the whole model, all resident
    assert record_pool_bytes(small, 3, chunk, resident=True) == _caps(small, [0, 1])
    assert plan_resident(small, _caps(small, [0, 1]), 3, chunk) == [0, 1]
    # blocks updated in chunks always stream: the chunk's buffers stay, the records above them are kept
    mixed = _layout([3_000_000, 200_000, 200_000])
    unit = align_up(chunk_record_bytes(1 << 20, 2))
    assert record_pool_bytes(mixed, 3, 1 << 20, resident=True) == 3 * unit


def test_blocks_updated_in_chunks_stay_whole_where_the_budget_allows():
    """A block updated in chunks is a candidate like any other: resident, it keeps one buffer per chunk (its whole
    record); streamed, it takes a chunk's buffer. The durability interval needs every record resident."""
    layout = _layout([3_500_000] + [1_000_000] * 6)
    chunk = 1 << 20  # the embedding is updated in four chunks, the layers whole
    unit = align_up(chunk_record_bytes(chunk, 2))
    whole = layout.blocks[0].units_bytes(chunk)
    every = whole + _caps(layout, list(range(1, 7)))
    assert 3 * unit < whole < 4 * unit
    assert plan_resident(layout, every, 3, chunk_elems=chunk) == list(range(7))  # all of them, the embedding too
    assert record_pool_bytes(layout, 3, chunk, resident=True) == 3 * unit  # the least pool streams every chunk
    # a budget short of every record: the embedding streams through three chunk buffers, the lowest layers stay
    chosen = plan_resident(layout, 6 * unit, 3, chunk_elems=chunk)
    assert 0 not in chosen and chosen == [1, 2, 3]
    # room for the embedding and three streamed layers: the embedding stays, as a tied one does
    layer = align_up(layout.blocks[1].record_bytes)
    assert plan_resident(layout, whole + 3 * layer, 3, chunk_elems=chunk) == [0]
    ecfg = config(["d"], resident_mem="all", opt_chunk_bytes=unit)
    plan = plan_host_memory(PoolGeometry(layout), ecfg)
    assert plan.records + plan.resident == every and plan.resident_blocks == tuple(range(7))


def _run(mcfg, ecfg, data, lookahead=True):
    losses, metrics = [], []
    with lohan.init(mcfg, ecfg) as engine:
        resident = engine.offloader.resident
        for k, batch in enumerate(data):
            nxt = data[k + 1] if lookahead and k + 1 < len(data) else None
            losses.append(engine.step(batch, next_batch=nxt))
            metrics.append(engine.last_stats.to_dict())
        params = engine.state_dict_fp32()
    return losses, metrics, params, resident


@pytest.mark.parametrize("mode,clip_mode", [("optimized", "defer"), ("optimized", "speculate"),
                                            ("optimized", "auto"), ("serial", "auto"), ("naive", "auto")])
@pytest.mark.usefixtures("streamed")
def test_resident_records_are_bit_exact_and_skip_their_reads(make_dirs, mode, clip_mode):
    mcfg = tiny_cfg(n_layer=12, vocab_size=4096)  # an embedding 5x a layer: it and a few layers stay, the rest stream
    data = list(batches(STEPS))
    ecfg = config(make_dirs(2), mode=mode, clip_mode=clip_mode, resident_mem="3MiB")  # room for ~4 layers
    ref_losses, _, ref_params = reference(mcfg, ecfg, data)
    losses, metrics, params, resident = _run(mcfg, ecfg, data)
    assert losses == ref_losses
    same_weights(params, ref_params)
    assert resident[:4] == [0, 1, 2, 3] and len(resident) < 14  # the lowest blocks first, some streamed
    hits = [m["resident_record_hits"] for m in metrics]
    assert hits[0] == 0 and max(hits) == len(resident)  # nothing in memory before the first step
    # a redone step reads its resident records again (the speculative pass changed them): fewer hits there
    redone = [m["redone"] for m in metrics]
    assert all(h == len(resident) for h, r in zip(hits[1:], redone[1:]) if not r)
    off = _run(mcfg, config(make_dirs(2, "off"), mode=mode, clip_mode=clip_mode, resident_records=False), data)
    assert off[0] == losses and off[3] == []
    assert all(m["resident_record_hits"] == 0 for m in off[1])
    saved = sum(o["ssd_read_bytes"] - m["ssd_read_bytes"] for o, m in zip(off[1][1:], metrics[1:]))
    assert saved > 0


@pytest.mark.usefixtures("streamed")
def test_a_speculative_pass_that_is_discarded_leaves_no_trace_in_the_resident_records(make_dirs):
    """Speculation updates the records in place during backward; a non-finite step then discards them, and a
    whole-model pool keeps every block resident: the next step must read them all back from the SSDs."""
    mcfg = tiny_cfg()
    ecfg = config(make_dirs(1), clip_mode="speculate", max_inflight_blocks=8)
    metrics = check(mcfg, ecfg, poison={2, 3, 5})
    n = metrics[0]["resident_records"]
    assert n == 4  # embedding, two layers, head: the whole model
    hits = [m["resident_record_hits"] for m in metrics]
    # after a discarded pass, the blocks it updated (those whose gradients came before the norm was known)
    # are read again; the others still hold the committed bytes
    assert hits[1] == hits[2] == hits[7] == n, hits
    assert all(hits[k] <= n for k in (3, 4, 6)) and sum(hits[k] for k in (3, 4, 6)) < 3 * n, hits


@pytest.mark.usefixtures("streamed")
def test_a_dropped_tail_and_a_rollback_read_the_resident_records_again(make_dirs):
    """The pool holds the model, so every record is resident: when the tail of a step fails and the step is
    dropped, and when a later step fails in its backward, what follows reads the committed slot's bytes."""
    mcfg, ecfg = tiny_cfg(), config(make_dirs(1), clip_mode="defer", max_inflight_blocks=8, persist_every=1)
    data = list(batches(STEPS))
    ref_losses, _, ref_params = reference(mcfg, ecfg, data[:1] + data[2:])  # batch 1 never trained on
    with lohan.init(mcfg, ecfg) as engine:
        n = len(engine.offloader.resident)
        assert n == len(engine.layout.blocks)
        losses = [engine.step(data[0], next_batch=data[1])]
        engine.flush()
        faulty = inject_faults(engine.store.volume, "write#1+:EIO")
        engine.step(data[1], next_batch=data[2])
        # (the forward following the pass meets the failure where it takes a block, or the pass's end does)
        with pytest.raises(RuntimeError, match="optimizer pipeline failed|optimizer failed before providing"):
            engine.step(data[2], next_batch=data[3])
        engine.store.volume.backend = faulty.inner
        losses.append(engine.step(data[2], next_batch=data[3]))
        assert engine.last_stats.resident_record_hits == 0  # the dropped step's bytes were not used
        real = engine.program.run
        engine.program.run = lambda i, x, t: (_ for _ in ()).throw(OSError("boom")) if i == 1 else real(i, x, t)
        with pytest.raises(OSError, match="boom"):
            engine.step(data[3], next_batch=data[4])
        engine.program.run = real
        for k in range(3, len(data)):
            losses.append(engine.step(data[k], next_batch=data[k + 1] if k + 1 < len(data) else None))
        params = engine.state_dict_fp32()
    assert losses == ref_losses
    same_weights(params, ref_params)


def test_config_refuses_a_non_boolean_resident_records():
    with pytest.raises(ValueError, match="resident_records"):
        config(["d"], resident_records="yes")


@pytest.mark.usefixtures("streamed")
def test_resident_mem_keeps_more_records_within_cpu_mem(make_dirs):
    """resident_mem widens the record pool, never beyond all records; with room for all, the model's states
    are read once and then only written, with the same bits."""
    mcfg = tiny_cfg(n_layer=12, vocab_size=4096)
    data = list(batches(4))
    base = config(make_dirs(1), clip_mode="defer", resident_mem=0)
    ref_losses, _, ref_params = reference(mcfg, base, data)
    with lohan.init(mcfg, base) as engine:
        pool, some = engine.records_pool.budget_bytes, engine.offloader.resident
        assert engine.memory_plan["resident"] == 0
        records = sum(align_up(b.record_bytes) for b in engine.layout.blocks)
    ecfg = config(make_dirs(1, "more"), clip_mode="defer", resident_mem="64MiB")
    losses, metrics, params, resident = _run(mcfg, ecfg, data)
    assert losses == ref_losses
    same_weights(params, ref_params)
    assert len(some) < len(resident) == 14
    assert [m["resident_record_hits"] for m in metrics] == [0, 14, 14, 14]
    with lohan.init(mcfg, ecfg, overwrite=True) as engine:  # the plan takes what all records need, not 64 MiB
        assert engine.records_pool.budget_bytes == records
        assert engine.memory_plan["resident"] == records - pool
    with lohan.init(mcfg, ecfg.with_overrides(resident_mem="all"), overwrite=True) as engine:
        assert engine.records_pool.budget_bytes == records and len(engine.offloader.resident) == 14


@pytest.mark.parametrize("clip", [1.5, 0.0])
@pytest.mark.usefixtures("streamed")
def test_resident_mem_all_keeps_records_updated_in_chunks_and_stays_exact(make_dirs, clip):
    """Blocks bigger than a chunk stay too (one buffer per chunk): `all` keeps every record, the pool holds them
    all and no more, nothing is read after the first step, and the bits are plain PyTorch's."""
    mcfg, data = tiny_cfg(n_layer=3, vocab_size=4096), list(batches(4))
    ecfg = config(make_dirs(1), clip_mode="defer", opt_chunk_bytes="1MiB", resident_mem="all", persist_every=1,
                  max_grad_norm=clip)
    ref_losses, _, ref_params = reference(mcfg, ecfg, data)
    with lohan.init(mcfg, ecfg) as engine:
        blocks, chunk = engine.layout.blocks, engine.store.chunk_elems
        assert [b.index for b in blocks if b.numel > chunk] == [0]  # the embedding, in five chunks
        assert engine.offloader.resident == [b.index for b in blocks]
        assert engine.records_pool.budget_bytes == sum(b.units_bytes(chunk) for b in blocks)
        assert engine.persist_refusal is None
    losses, metrics, params, _ = _run(mcfg, ecfg.with_overrides(nvme=tuple(make_dirs(1, "run"))), data)
    assert losses == ref_losses
    same_weights(params, ref_params)
    assert [m["resident_record_hits"] for m in metrics] == [0, 5, 5, 5]
    assert all(m["ssd_read_bytes"] == 0 for m in metrics[1:])


def test_config_takes_resident_mem_sizes_all_and_auto():
    assert config(["d"], resident_mem="1GiB").resident_mem == 2**30
    assert config(["d"], resident_mem="all").resident_mem == "all"
    assert config(["d"]).resident_mem == "auto"  # the default
    assert config(["d"], resident_records=False).resident_mem == "auto"  # (then keeps nothing)


def _plan(**kw):
    """plan_host_memory of a synthetic model (an embedding 3.6x a layer, twelve layers, a norm)."""
    layout = _layout([3_600_000] + [1_000_000] * 12 + [4096])
    ecfg = config(["d"], **kw)
    return ecfg, lambda free=None: plan_host_memory(PoolGeometry(layout, owners=1), ecfg, free=free).parts()


def test_resident_mem_auto_takes_half_of_what_cpu_mem_and_free_memory_leave():
    """auto: every record when the budget has room, half of what is left when it has less, nothing when
    nothing is left (or resident_records is off); the machine's free memory bounds it as cpu_mem does."""
    ecfg, plan = _plan(cpu_mem="1GiB")
    roomy = plan()
    others = sum(v for k, v in roomy.items() if k != "resident")
    assert 0 < roomy["resident"] < ecfg.cpu_mem - others  # all of them: capped at what keeps every record
    every = roomy["resident"]
    tight = plan(free=others + every)  # half of the rest
    assert tight["resident"] == every // 2
    assert plan(free=others)["resident"] == 0
    assert {k: v for k, v in tight.items() if k != "resident"} == {k: v for k, v in roomy.items() if k != "resident"}
    _, plan_small = _plan(cpu_mem=others + every // 3)
    assert plan_small()["resident"] == (every // 3) // 2
    _, plan_off = _plan(cpu_mem="1GiB", resident_records=False)
    assert plan_off()["resident"] == 0


@pytest.mark.usefixtures("streamed")
def test_resident_mem_auto_keeps_every_record_of_a_small_model_and_stays_exact(make_dirs):
    mcfg = tiny_cfg(n_layer=12, vocab_size=4096)
    data = list(batches(4))
    ecfg = config(make_dirs(1), clip_mode="defer", cpu_mem="1GiB")
    ref_losses, _, ref_params = reference(mcfg, ecfg, data)
    losses, metrics, params, resident = _run(mcfg, ecfg, data)
    assert losses == ref_losses
    same_weights(params, ref_params)
    assert len(resident) == 14 and [m["resident_record_hits"] for m in metrics] == [0, 14, 14, 14]
    assert all(m["ssd_read_bytes"] == 0 for m in metrics[1:])


@pytest.mark.parametrize("kw,match", [({"resident_mem": "-1MiB"}, "resident_mem: .-1MiB. is below zero"),
                                      ({"resident_mem": "lots"}, "resident_mem: cannot read 'lots' as a size"),
                                      ({"resident_mem": "1GiB", "resident_records": False},
                                       "resident_mem=.* needs resident_records=true")])
def test_config_refuses_a_bad_resident_mem(kw, match):
    with pytest.raises(ValueError, match=match):
        config(["d"], **kw)


def test_the_run_header_says_how_many_records_stay_and_what_keeps_them_all(make_dirs):
    from lohan.app.header import resident_line

    mcfg = tiny_cfg(n_layer=12, vocab_size=4096)
    with lohan.init(mcfg, config(make_dirs(1), resident_mem=0)) as engine:
        others = sum(v for k, v in engine.memory_plan.items() if k != "resident")
        line = resident_line(engine.describe())
    assert re.fullmatch(r"\d+ of 14 blocks; --set engine.resident_mem=\d+MiB keeps all of them \(within cpu_mem\)",
                        line), line
    with lohan.init(mcfg, config(make_dirs(1, "tight"), cpu_mem=others + 2**20)) as engine:  # auto: half a MiB
        assert 0 < engine.memory_plan["resident"] <= 2**19
        line = resident_line(engine.describe())
    cpu = re.search(r"^\d+ of 14 blocks; --cpu-mem ([0-9.]+)GiB keeps all of them", line)
    assert cpu, line
    with lohan.init(mcfg, config(make_dirs(1, "roomy"), cpu_mem=f"{cpu.group(1)}GiB")) as engine:
        assert resident_line(engine.describe()) == "14 of 14 blocks"


@pytest.mark.parametrize("kw", [dict(clip_mode="defer"), dict(clip_mode="speculate", tied=True),
                                dict(persist_every=3, micro_batches=2), dict(slots=1)])
def test_the_host_device_computes_on_its_resident_records_without_a_copy_of_their_p16(make_dirs, kw):
    """On the CPU, fp32 compute on fp32 masters: the parameters of a resident block are views of its record (no
    P16 buffer of the params pool is ever taken, from the first step on), and the run stays bit-exact."""
    kw = dict(kw)
    mcfg = tiny_cfg(tie_embeddings=kw.pop("tied", False))
    ecfg = config(make_dirs(1), max_inflight_blocks=8, **kw)
    data = list(batches(STEPS))
    ref_losses, _, ref_params = reference(mcfg, ecfg, data)
    losses = []
    with lohan.init(mcfg, ecfg) as engine:
        assert len(engine.offloader.resident) == len(engine.layout.blocks)
        for k, batch in enumerate(data):
            losses.append(engine.step(batch, next_batch=data[k + 1] if k + 1 < len(data) else None))
        assert engine.params_pool.stats()["peak_allocated"] == 0
        assert engine.streamer.zero_copies >= STEPS * len(engine.layout.blocks)
        params = engine.state_dict_fp32()
    assert losses == ref_losses
    same_weights(params, ref_params)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_plan_gives_no_p16_buffer_to_the_records_the_cpu_computes_on(dtype):
    """The CPU computes on every resident record in place (fp32: the master is the P16; bf16: the record keeps its
    own), so the params pool holds only the blocks that stream; a separate device, or several ranks, keep theirs.
    A block updated in chunks whose one parameter spans them streams (its P16 is in several buffers)."""
    from lohan.plan.records import layout_of
    from lohan.plan.run_plan import plan_run

    layout = layout_of([3_600_000] + [1_000_000] * 4, dtype)
    ecfg = config(["d"], compute_dtype=dtype, resident_mem="all", cpu_mem="1GiB")
    p16 = [align_up(b.p16_itemsize * b.numel) for b in layout.blocks]
    apart = plan_host_memory(PoolGeometry(layout), ecfg)
    assert apart.zero_copy == () and apart.params == sum(p16)
    cpu = plan_host_memory(PoolGeometry(layout), ecfg, host_device=True)
    assert cpu.resident_blocks == cpu.zero_copy == tuple(range(5))
    assert cpu.params == 0 and cpu.params_saved == sum(p16) and cpu.total == apart.total - sum(p16)
    assert plan_run(ecfg, PoolGeometry(layout), host_device=True).kept_p16 == 1.0  # none of them is read
    assert plan_host_memory(PoolGeometry(layout), ecfg, world=2, host_device=True).zero_copy == ()
    chunked = ecfg.with_overrides(opt_chunk_bytes="16MiB")  # the 3.6M-element block in chunks
    part = plan_host_memory(PoolGeometry(layout), chunked, host_device=True)
    assert 0 in part.resident_blocks and part.zero_copy == (1, 2, 3, 4) and part.params == p16[0]


@pytest.mark.parametrize("kw", [dict(mode="serial"), dict(mode="optimized", clip_mode="defer", max_inflight_blocks=2),
                                dict(mode="optimized", persist_every=3, max_grad_norm=0.0, max_inflight_blocks=2)])
@pytest.mark.usefixtures("streamed")
def test_a_separate_device_takes_the_p16_of_a_durable_slot_from_the_records_that_hold_it(make_dirs, kw):
    """Every record resident and a durable slot the current one: its P16 is also in the records (the step that
    wrote the slot wrote it from there), so a forward, a recompute and a step after a durable one copy it from memory
    and read none of it from the SSDs, also where the params pool has no room to keep what the optimizer hands over.
    The same bits as plain PyTorch."""
    mcfg = tiny_cfg(n_layer=4)
    ecfg = config(make_dirs(1), resident_mem="all", **kw)
    data = list(batches(STEPS))
    ref_losses, _, ref_params = reference(mcfg, ecfg, data)
    losses, read = [], []
    with lohan.init(mcfg, ecfg) as engine:
        assert len(engine.offloader.resident) == len(engine.layout.blocks)
        for k, batch in enumerate(data):
            before = engine.streamer.bytes_read
            losses.append(engine.step(batch, next_batch=data[k + 1] if k + 1 < len(data) else None))
            read.append(engine.streamer.bytes_read - before)
        params = engine.state_dict_fp32()
    assert read[0] > 0  # the first step finds nothing in memory
    assert read[1:] == [0] * (STEPS - 1), read
    assert losses == ref_losses
    same_weights(params, ref_params)


@pytest.mark.parametrize("kw", [dict(persist_every=3, max_grad_norm=0.0), dict(clip_mode="defer"),
                                dict(clip_mode="speculate")])
@pytest.mark.usefixtures("streamed")
def test_the_optimizer_hands_a_resident_records_p16_over_without_copying_it(make_dirs, kw):
    """Every record resident: the optimizer's thread copies no P16 for the next forward (neither into a hand-over
    nor into a provision the forward follows); the forward copies it from the record, which holds it, on its own
    thread. The same bits as plain PyTorch."""
    mcfg = tiny_cfg(n_layer=4)
    ecfg = config(make_dirs(1), resident_mem="all", **kw)
    data = list(batches(STEPS))
    ref_losses, _, ref_params = reference(mcfg, ecfg, data)
    losses, overlapped = [], []
    with lohan.init(mcfg, ecfg) as engine:
        for k, batch in enumerate(data):
            losses.append(engine.step(batch, next_batch=data[k + 1] if k + 1 < len(data) else None))
            overlapped.append(engine.last_stats.next_forward_overlapped)
        streamer = engine.streamer
        assert (streamer.offered_bytes, streamer.handed_over) == (0, 0)
        params = engine.state_dict_fp32()
    assert any(overlapped) or kw.get("clip_mode") == "speculate"  # (a forward followed a pass)
    assert losses == ref_losses
    same_weights(params, ref_params)


@pytest.mark.parametrize("kw", [dict(tied=True), dict(clip_mode="defer"), dict(max_grad_norm=0.0)])
def test_the_host_device_hands_autograds_gradients_to_the_optimizer_without_a_copy(make_dirs, kw):
    """On the CPU, one micro-batch: each block's gradients go to the optimizer as autograd made them (no copy into a
    host gradient buffer, and no buffer: the grads pool allocates nothing, as the plan says), clipped (speculated and
    redone, or deferred: the stash keeps them) or not, and the run stays bit-exact."""
    kw = dict(kw)
    mcfg = tiny_cfg(tie_embeddings=kw.pop("tied", False))
    ecfg = config(make_dirs(1), max_inflight_blocks=8, **kw)
    data = list(batches(STEPS))
    ref_losses, _, ref_params = reference(mcfg, ecfg, data)
    losses = []
    with lohan.init(mcfg, ecfg) as engine:
        host = engine.run_plan.host
        assert host.grads_handed and engine.run_plan.pools()["grads"] < host.grads + host.grad_stash
        for k, batch in enumerate(data):
            losses.append(engine.step(batch, next_batch=data[k + 1] if k + 1 < len(data) else None))
        assert engine.passes.grad_copy_bytes == 0
        assert engine.grads_pool.stats()["peak_allocated"] == 0
        assert engine.grads_pool.budget_bytes == engine.run_plan.pools()["grads"]
        params = engine.state_dict_fp32()
    assert losses == ref_losses
    same_weights(params, ref_params)


def test_gradients_summed_over_micro_batches_are_copied_into_the_grads_pool(make_dirs):
    """Two micro-batches are summed into a host buffer: the copy is counted, and the plan keeps the grads pool."""
    mcfg = tiny_cfg()
    with lohan.init(mcfg, config(make_dirs(1), micro_batches=2)) as engine:
        assert not engine.run_plan.host.grads_handed
        engine.step(next(batches(1)))
        assert engine.passes.grad_copy_bytes == 4 * engine.layout.param_count
        assert 0 < engine.grads_pool.stats()["peak_allocated"] <= engine.run_plan.pools()["grads"]


def test_a_deferred_update_gives_each_gradient_back_once_its_block_is_updated(make_dirs, monkeypatch):
    """The stash keeps a deferred step's gradients (autograd's own on the CPU) until their update, not to the step's
    end: held that long they shared the heap with the next forward's activations (a redo's are kept: speculated)."""
    from lohan.store.gradstash import GradStash

    left: list[int] = []
    real = GradStash.clear

    def clear(self):
        left.append(self.ram_used)
        real(self)

    monkeypatch.setattr(GradStash, "clear", clear)
    data = list(batches(3))
    with lohan.init(tiny_cfg(), config(make_dirs(1), clip_mode="defer")) as engine:
        for k, batch in enumerate(data):
            engine.step(batch, next_batch=data[k + 1] if k + 1 < len(data) else None)
            assert engine.last_stats.deferred
    assert left and set(left) == {0}

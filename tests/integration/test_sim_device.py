"""The simulated device (LOHAN_DEVICE=sim): the CPU suite's way to fail on device bugs.

On a plain CPU run a device tensor and a host buffer are the same kind of tensor and every copy is synchronous,
so a missing copy, event or wait changes nothing. Here the CPU behaves as a separate device would
(lohan/runtime/simdevice.py). The first half checks that the simulation fails where CUDA would (each check is a bug the
engine could have); the second runs the engine's equivalence tests on it: every mode, tied and untied,
micro-batches, swapping to both tiers, clipping, fp16 and data parallel, bit-exact against plain PyTorch.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lohan
import lohan.runtime.engine
from io_engine import BufferPool
from lohan.runtime.activation_store import SelectiveMode
from lohan.runtime.device import Device
from lohan.runtime.simdevice import SIM_DEVICE, DeviceMixError, SimTensor, StreamOrderError
from tests.integration import test_engine_equivalence as eq
from tests.integration import test_hf_families as families
from tests.integration import test_parallel as parallel
from tests.integration.test_hf_families import family_dir  # noqa: F401 - a fixture the HF test below takes
from tests.unit.runtime import test_activations as acts
from tests.unit.runtime import test_clipping as clip
from tests.unit.runtime import test_persist_every as persist
from tests.unit.runtime import test_resident_records as resident


@pytest.fixture
def dev():
    d = Device("sim")
    yield d
    d.close()


# ------------------------------------------------------------------------------------ the simulation
def test_finding_1_host_gradient_accumulation_raises_as_cuda_does(dev):
    """What the engine once did to accumulate device gradients into views of a host buffer: every form raises
    on the simulated device (CUDA: "Expected all tensors to be on the same device"); copy_ crosses."""
    host = torch.zeros(6)
    g = dev.put(torch.ones(6))
    other = dev.put(torch.full((6,), 2.0))
    with pytest.raises(DeviceMixError):
        torch.add(g, other, out=host)  # a tied parameter's two contributions, summed into the host view
    with pytest.raises(DeviceMixError):
        host.add_(g)  # every micro-batch after the first
    with pytest.raises(DeviceMixError):
        torch.zeros_like(host) + other  # an unused parameter's zeros beside a device contribution
    host.copy_(g)  # a copy may cross, as on CUDA
    assert torch.equal(host, torch.ones(6)) and dev.syncs == 1  # ... and it is a synchronization
    assert isinstance(g * torch.tensor(3.0), SimTensor)  # 0-dim host tensors mix, as CPU scalars do with CUDA


def test_device_tensors_report_their_own_device_and_factories_follow_it(dev):
    x = dev.put(torch.arange(4.0))
    assert x.device == SIM_DEVICE and x.device != torch.device("cpu")
    with dev.autocast(None):
        y = torch.arange(4, device=x.device)  # model code's way of making a tensor beside its input
        z = torch.empty(3)  # a host tensor, as on a GPU
    assert isinstance(y, SimTensor) and not isinstance(z, SimTensor)
    back = x.cpu()
    assert not isinstance(back, SimTensor) and torch.equal(back, torch.arange(4.0))


def test_ops_that_return_lists_and_named_tuples_keep_their_shape_on_the_device(dev):
    """The device walks an op's arguments and results itself (torch's generic pytree walk was most of its per-op
    time): lists in, lists and torch.return_types out, every tensor wrapped, the values as on the host."""
    host = torch.tensor([[3.0, 1.0], [2.0, 5.0]])
    x = dev.put(host)
    with dev.autocast(None):
        top = torch.max(x, dim=1)
        parts = torch.split(x, 1)
        joined = torch.cat([x, x], dim=0)
    assert type(top) is type(torch.max(host, dim=1)) and all(isinstance(t, SimTensor) for t in top)
    assert torch.equal(top.values.cpu(), torch.tensor([3.0, 5.0])) and torch.equal(top.indices.cpu(), torch.tensor([0, 1]))
    assert isinstance(parts, tuple) and len(parts) == 2 and all(isinstance(t, SimTensor) for t in parts)
    assert torch.equal(joined.cpu(), torch.cat([host, host]))


def test_compute_before_waiting_for_the_copy_raises(dev):
    host = torch.arange(8.0)
    t = dev.to_device(host)
    with pytest.raises(StreamOrderError, match="without waiting"):
        t.tensor.sum()
    dev.wait(t.event)
    assert float(dev.fetch(t.tensor.sum())) == 28.0


def test_a_copy_reads_the_host_buffer_late(dev):
    """The copy runs on the worker after a delay: a host buffer changed after `to_device` is what it copies."""
    host = torch.zeros(4)
    t = dev.to_device(host)
    host.fill_(7.0)  # a bug: the host reused the buffer before the copy's event
    dev.wait(t.event)
    assert torch.equal(dev.fetch(t.tensor), torch.full((4,), 7.0))


def test_giving_back_a_buffer_before_its_copy_is_seen_raises_and_released_buffers_are_poisoned(dev):
    pool = BufferPool(1 << 16)
    buf = pool.acquire(4096)
    buf.tensor.view(torch.float32).fill_(1.0)
    t = dev.to_device(buf.tensor.view(torch.float32))
    dev.wait(t.event)  # the compute stream waited, the host did not see the event complete
    with pytest.raises(StreamOrderError, match="given back"):
        buf.release()
    assert t.event.query()
    buf.release()
    assert torch.isnan(buf._full.view(torch.float32)).all()  # a read after release reads NaN
    again = pool.acquire(4096)
    again.keep("k")  # kept: its bytes are retained, not poisoned
    assert torch.isnan(pool.take_kept("k").tensor.view(torch.float32)).all()


def test_a_host_that_reads_a_download_before_its_event_reads_nan(dev):
    x = dev.put(torch.arange(6.0))
    out = torch.empty(6)
    ev = dev.to_host(x, out)
    assert torch.isnan(out).all()  # the copy has not run yet
    ev.synchronize()
    assert torch.equal(out, torch.arange(6.0))


def test_a_download_must_follow_the_compute_that_wrote_it(dev):
    x = dev.put(torch.arange(6.0)) * 2
    with pytest.raises(StreamOrderError, match="compute stream wrote"):
        dev.sim.d2h(x, torch.empty(6))  # without the download stream waiting for the compute stream
    ev = dev.to_host(x, out := torch.empty(6))
    with pytest.raises(StreamOrderError, match="still reads"):
        x.add_(1)  # overwriting what the copy still reads
    ev.synchronize()
    x.add_(1)
    assert torch.equal(out, torch.arange(6.0) * 2)


class _CudaLikeEfficientAttention(TorchDispatchMode):
    """CUDA's memory-efficient SDPA on the CPU: the logsumexp is computed only when asked for."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is not torch.ops.aten._scaled_dot_product_efficient_attention.default:
            return func(*args, **(kwargs or {}))
        q, k, v, _, want_lse = args[:5]
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        lse = torch.logsumexp(scores, -1) if want_lse else torch.empty(0)
        return torch.softmax(scores, -1) @ v, lse, torch.empty(()), torch.empty(())


def test_records_ask_attention_kernels_for_the_logsumexp_backward_needs():
    """Finding 2: records are taken under no_grad, where SDPA asks the memory-efficient and cuDNN kernels for no
    logsumexp; the record must hold it (the replayed backward needs it), and its bytes are counted."""
    tracker = type("Tracker", (), {"current": "attn"})()
    q = torch.randn(1, 2, 8, 4)
    efficient = torch.ops.aten._scaled_dot_product_efficient_attention.default
    with torch.no_grad(), _CudaLikeEfficientAttention():
        assert efficient(q, q, q, None, False)[1].numel() == 0  # what a plain no_grad call returns
        mode = SelectiveMode(tracker, frozenset({"attn"}))
        with mode:
            efficient(q, q, q, None, False)
    (rec,) = mode.records
    assert rec.leaves[1].shape == (1, 2, 8)  # the logsumexp, recorded with the output
    with _CudaLikeEfficientAttention():
        replay = SelectiveMode(tracker, frozenset({"attn"}), replay=mode.records)
        with replay:  # the recompute under grad asks for it too: the same call, replayed
            out, lse = efficient(q, q, q, None, True)[:2]
        replay.check_done()
    assert torch.equal(lse, rec.leaves[1])


def test_records_pack_device_outputs_and_leave_host_outputs_and_nones_as_they_are(dev, make_dirs):
    """Finding 3, from the first CUDA run: CUDA's flash and memory-efficient attention return their RNG seed and
    offset as host tensors, and some outputs are None. A record packs and copies only device tensors (a host one
    given to the copy stream crashed, `record_stream` on a CPU tensor), and a None output comes back as None
    (it was taken for a packed slot, and the record's leaves ran out)."""
    from io_engine import open_volume
    from lohan.runtime.activation_store import ActivationStore, OpRecord

    vol = open_volume(make_dirs(1), 1 << 20, backend="threads", name="acts")
    store = ActivationStore(dev, BufferPool(1 << 20), vol.buffer_pool(1 << 20), vol)
    out, lse, seed = dev.put(torch.randn(2, 8, 4)), dev.put(torch.randn(2, 8)), torch.tensor(105685)
    x = dev.put(torch.randn(2, 8, 4))
    try:
        for tier in ("keep", "cpu", "ssd"):
            leaves = [out, lse, None, None, seed, torch.tensor(0), 3]
            store.put((1, 0), x, [OpRecord("attn", "aten.fake", None, list(leaves))], tier)
            store.end_forward()
            store.prefetch([(1, 0)])
            got_x, (rec,) = store.take((1, 0))
            assert len(rec.leaves) == len(leaves)
            for want, got in zip([x, out, lse], [got_x, *rec.leaves[:2]]):
                assert isinstance(got, SimTensor) and torch.equal(dev.fetch(got), dev.fetch(want))
            assert rec.leaves[2:4] == [None, None] and rec.leaves[4] is seed and rec.leaves[6] == 3
            store.release((1, 0))
        store.end_step()
    finally:
        vol.close()


# ------------------------------------------------------------------------------- the engine on the simulation
@pytest.fixture
def sim(monkeypatch):
    """Engines built with device 'auto' run on the simulated device; checks that they did, and that they moved
    tensors with the device's copies."""
    monkeypatch.setenv("LOHAN_DEVICE", "sim")
    built = []
    real = lohan.runtime.engine.Device

    def device(kind: str = "auto", **kw) -> Device:
        d = real(kind, **kw)
        built.append(d)
        return d

    monkeypatch.setattr(lohan.runtime.engine, "Device", device)
    yield built
    assert built and all(d.type == "sim" for d in built), [d.type for d in built]
    assert any(d.sim.copies["h2d"] > 0 and d.sim.copies["d2h"] > 0 for d in built)


def test_an_engine_step_syncs_a_fixed_number_of_times_and_keeps_parameters_on_the_device(sim, make_dirs):
    """No per-block host synchronization: the host reads the loss, the gradient norm and the clip coefficient
    once a step, whatever the number of blocks."""
    per_step = {}
    for n_layer in (2, 5):
        with lohan.init(eq.tiny_cfg(n_layer=n_layer), eq.engine_config(make_dirs(1, f"l{n_layer}"),
                                                                      name=f"l{n_layer}")) as engine:
            data = list(eq.batches(3, 4, 32, 256))
            engine.step(data[0])
            before = engine.device.syncs
            engine.step(data[1])
            per_step[n_layer] = engine.device.syncs - before
            params = engine.streamer.acquire(1, engine.store.slot)
            assert all(isinstance(p, SimTensor) for p in params)
            engine.streamer.release_all()
    assert per_step[2] == per_step[5] <= 4, per_step


@pytest.mark.parametrize("mode", ["serial", "naive", "optimized"])
def test_every_mode_is_bit_exact_on_the_simulated_device(sim, make_dirs, mode):
    eq.test_bit_exact_fp32_every_mode(make_dirs, mode, 1)


@pytest.mark.parametrize("tied", [True, False])
def test_micro_batches_tied_and_untied_on_the_simulated_device(sim, make_dirs, tied):
    eq.test_bit_exact_with_gradient_accumulation(make_dirs, tied)


def test_chunked_updates_on_the_simulated_device(sim, make_dirs):
    eq.test_bit_exact_with_blocks_updated_in_chunks(make_dirs, "optimized")


def test_bf16_gradient_buffers_on_the_simulated_device(sim, make_dirs, monkeypatch):
    eq.test_bf16_gradient_buffers_change_nothing(make_dirs, monkeypatch)


@pytest.mark.parametrize("policy", ["interblock", "swap-all"])
def test_swapped_activations_on_the_simulated_device(sim, make_dirs, policy):
    """Records leave the device (to the CPU pool, micro-batched) and come back ahead of their block."""
    acts.test_every_policy_bit_exact_fp32(make_dirs, policy)


def test_swapped_activations_through_the_ssds_on_the_simulated_device(sim, make_dirs):
    acts.test_activations_beyond_memory_budget_go_through_ssd(make_dirs, "swap-all", "threads")


@pytest.mark.parametrize("clip_mode", ["speculate", "defer"])
def test_clipping_on_the_simulated_device(sim, make_dirs, clip_mode):
    clip.test_clipping_is_bit_exact(make_dirs, "optimized", clip_mode)


def test_next_forward_beside_the_optimizer_on_the_simulated_device(sim, make_dirs):
    clip.test_next_forward_beside_the_deferred_or_redone_pass_is_bit_exact(make_dirs, "auto")


def test_non_finite_steps_on_the_simulated_device(sim, make_dirs):
    clip.test_non_finite_steps_are_skipped_exactly_like_a_guarded_loop(make_dirs, 2)


@pytest.mark.parametrize("tied", [True, False])
def test_fp16_loss_scaling_on_the_simulated_device(sim, make_dirs, tied):
    clip.test_fp16_dynamic_loss_scaling_follows_grad_scaler(make_dirs, tied)


def test_resident_records_on_the_simulated_device(sim, make_dirs):
    resident.test_resident_records_are_bit_exact_and_skip_their_reads(make_dirs, "optimized", "defer")


def test_an_interval_with_records_updated_in_chunks_on_the_simulated_device(sim, make_dirs):
    """Resident chunks between durable steps: their P16 copied from RAM piece by piece, then uploaded."""
    persist.test_an_interval_with_a_record_updated_in_chunks_trains_the_same_bits_as_pytorch(make_dirs, 1.5, 3)


@pytest.mark.parametrize("case", ["clips", "not finite", "tail follows", "tail follows, no hand-over"])
def test_steps_held_in_ram_updated_in_place_and_replayed_on_the_simulated_device(sim, make_dirs, caplog, monkeypatch,
                                                                                 case):
    """In-place updates during backward of RAM-only states, the P16 handed over to the next forward, the blocks left
    when backward ends updated in forward order with the next forward following, and the replay of a step that clips
    (speculated) or is not finite: the same bits, every copy ordered."""
    if case == "clips":
        persist.test_a_speculated_step_held_in_ram_that_clips_is_replayed_at_its_coefficient(make_dirs, caplog)
    elif case.startswith("tail follows"):
        persist.test_once_backward_ends_the_blocks_left_update_in_forward_order_and_the_next_forward_follows(
            make_dirs, monkeypatch, handover=case == "tail follows")
    else:
        persist.test_a_non_finite_step_that_updated_ram_in_place_is_replayed_and_skipped(make_dirs, caplog)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3_text"])
def test_hf_families_on_the_simulated_device(sim, family_dir, make_dirs, tmp_path, family):  # noqa: F811
    """Hugging Face decoders on the device: their rotary tables and masks (made by the decoder's own forward)
    must be on the device the layers run on; Mistral's sliding window and Gemma 3's mixed layers included."""
    families.test_family_trains_bit_exact_exports_and_generates(family_dir, make_dirs, tmp_path, family)


def test_data_parallel_on_the_simulated_device(monkeypatch, tmp_path):
    """Two torchrun ranks, each on its own simulated device (inherited through LOHAN_DEVICE), equal one
    process with two micro-batches: the gradients are copied to the host before they are summed there."""
    monkeypatch.setenv("LOHAN_DEVICE", "sim")
    parallel.test_two_ranks_equal_one_process_with_two_micro_batches(tmp_path, "optimized")


def test_a_run_whose_gpu_memory_plan_exceeds_the_device_is_refused_at_its_first_step(sim, make_dirs):
    """engine.gpu_mem emulates a GPU of that size: the first step, once the activation plan is known, refuses a
    run whose GPU memory plan (planner.gpu_need) does not fit it, listing the plan, before anything is written."""
    from lohan.plan.planner import GpuMemoryPlanError

    mcfg = eq.tiny_cfg()
    with lohan.init(mcfg, eq.engine_config(make_dirs(1, "small"), gpu_mem="1MiB", name="small")) as engine:
        with pytest.raises(GpuMemoryPlanError, match=r"needs .* but 1\.0 MiB is available.*params .*logits"):
            engine.step(next(eq.batches(1, 4, 32, 256)))
        assert engine.step_count == 0
    with lohan.init(mcfg, eq.engine_config(make_dirs(1, "big"), gpu_mem="1GiB", name="big")) as engine:
        engine.step(next(eq.batches(1, 4, 32, 256)))
        assert engine.gpu_plan and 0 < sum(engine.gpu_plan.values()) < 1 << 30


@pytest.mark.parametrize("policy", ["swap-all", "plan"])
def test_an_hf_models_gpu_memory_plan_prices_its_own_ops(sim, make_dirs, tmp_path, policy):
    """Finding 4, from the first CUDA run: an HF block's ops are its sub-modules (`self_attn`, `mlp`), which the
    analytic GPT profile does not have, so pricing the swap set raised KeyError at the first step on every GPU
    (the check runs where a GPU budget exists: CUDA always, here with gpu_mem). The run's measured profile
    prices it: the last block's record holds the swapped ops' bytes beside the block input."""
    from lohan.runtime.hf_engine import init_from_hf
    from tests.unit.models import test_hf as hft

    path = hft.make_hf_dir(tmp_path / "llama", "llama")
    ecfg = hft.engine_config(make_dirs(1), gpu_mem="1GiB", act_policy=policy)
    with init_from_hf(path, ecfg) as engine:
        engine.step(next(hft.batches(1, batch=4, seq=32)))
        profile, plan = engine.activations.profile, engine.activations.plan
        swapped = sum(op.bytes for op in profile.ops if op.name in plan.swap)
        assert engine.gpu_plan["last block kept"] == profile.input_bytes + swapped
        assert policy != "swap-all" or swapped > 0


def test_each_blocks_copy_to_the_device_starts_while_the_block_before_it_computes(sim, make_dirs):
    """Only the first block of a step is copied when it is needed: every other block's P16 was copied ahead,
    once the block before it had been queued (the copy runs beside that block's compute on a GPU)."""
    with lohan.init(eq.tiny_cfg(n_layer=4), eq.engine_config(make_dirs(1))) as engine:
        for k, batch in enumerate(eq.batches(3, 4, 32, 256), start=1):
            engine.step(batch)
            assert engine.streamer.late_copies == k, engine.streamer.late_copies


def test_taking_the_forward_run_beside_the_last_pass_reads_nothing_back(sim, make_dirs):
    """The next step's forward, run beside this step's pass, is taken for the ids it ran on, compared on the host:
    fetching them from the device is a synchronization, which drained the compute stream at every step's start
    (the GPU then idles while the host issues backward)."""
    cfg = eq.engine_config(make_dirs(1), max_grad_norm=0.0, clip_mode="defer")  # the next forward beside each pass
    with lohan.init(eq.tiny_cfg(n_layer=2), cfg) as engine:
        data = list(eq.batches(4, 4, 32, 256))
        took = []
        real = engine._next.take

        def take(idx):
            before = engine.device.syncs
            prepared = real(idx)
            took.append((prepared is not None, engine.device.syncs - before))
            return prepared

        engine._next.take = take
        for s in range(3):
            engine.step(data[s], next_batch=data[s + 1])
        engine.step(data[0])  # another batch than the one prepared: dropped
    assert took == [(False, 0), (True, 0), (True, 0), (False, 0)]

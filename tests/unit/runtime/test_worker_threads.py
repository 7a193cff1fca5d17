"""The optimizer worker's intra-op threads (Device.worker_threads): on the CPU device the compute thread's pool
holds its cores already, so the worker takes the cores left over (at least one) instead of a second pool of as
many threads; beside a GPU (or the simulated one) it keeps torch's default."""

from __future__ import annotations

import os

import pytest
import torch

import lohan
from lohan.runtime.device import Device
from tests.unit.runtime.test_clipping import batches, config, tiny_cfg


@pytest.fixture
def two_compute_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("cores, expected", [(2, 1), (1, 1), (6, 4)])
def test_the_cpu_device_gives_the_worker_the_cores_left(monkeypatch, two_compute_threads, cores, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert Device("cpu").worker_threads() == expected
    assert Device("sim").worker_threads() is None  # a GPU computes elsewhere: every core for the optimizer


def test_the_engines_worker_runs_on_the_cores_left(make_dirs, monkeypatch, two_compute_threads):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    data = list(batches(2))
    with lohan.init(tiny_cfg(n_layer=2), config(make_dirs(1))) as engine:
        engine.step(data[0])
        worker = engine.offloader._executor.submit(torch.get_num_threads).result()
        assert worker == 1  # before: 2, a second pool on the compute thread's two cores
        assert torch.get_num_threads() == 2  # the compute thread's own count is untouched
        engine.step(data[1])

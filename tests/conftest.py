"""Shared fixtures: SSD directories under pytest's tmp_path, backend parametrization."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# device 'auto' means the CPU in tests, also on a CUDA machine: the plain-PyTorch references run on the CPU,
# and bit-exactness holds between runs on one device. The CUDA tests ask for device='cuda' themselves.
os.environ.setdefault("LOHAN_DEVICE", "cpu")
# lohan.app.cli.main turns an unexpected exception into "error: ..." and exit 2 for users; in tests it must
# propagate with its traceback, so a bug is never mistaken for a clean refusal
os.environ.setdefault("LOHAN_DEBUG", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The one rule of the `gpu` marker (the tests in tests/gpu): a test that needs CUDA is skipped, with the
    reason, where CUDA is missing; its file says only `pytestmark = pytest.mark.gpu`."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch

    if not torch.cuda.is_available():
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))


def _aio_status() -> tuple[bool, str]:
    from io_engine.aio import aio_available

    return aio_available()


BACKENDS = ["threads", "aio"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Every I/O test runs on both backends; aio is skipped (with the reason) where its op cannot load."""
    if request.param == "aio":
        ok, reason = _aio_status()
        if not ok:
            pytest.skip(f"aio backend unavailable: {reason}")
    return request.param


@pytest.fixture(autouse=True)
def _fresh_heap():
    """Each test starts with glibc's heap settings as a new process has them: an engine's `reuse_heap` is
    process-wide, and left on it kept every later test's big temporaries in a heap that never shrank (a 17 GiB
    mapping after the capacity tests, on which a test's fork() failed with ENOMEM)."""
    yield
    from lohan.runtime.heap import restore_heap_defaults

    restore_heap_defaults()


@pytest.fixture(autouse=True, scope="session")
def _token_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every run's token cache (lohan/data/token_cache.py) in this session's temporary folder, never the user's."""
    os.environ["LOHAN_DATA_CACHE"] = str(tmp_path_factory.mktemp("token-cache"))


@pytest.fixture
def make_dirs(tmp_path):
    """make_dirs(n) -> n fresh directories standing in for n SSDs."""

    def make(n: int, prefix: str = "nvme") -> list[str]:
        dirs = [str(tmp_path / f"{prefix}{i}") for i in range(n)]
        for d in dirs:
            os.makedirs(d, exist_ok=True)
        return dirs

    return make


@pytest.fixture(params=["kernel", "torch"])
def update_path(request, monkeypatch):
    """A test on both paths of a compressed state format's update: compiled (`lohan.runtime.format_kernel`) and
    torch ops (`LOHAN_FORMAT_KERNEL=0`)."""
    from lohan.runtime import format_kernel

    monkeypatch.setenv("LOHAN_FORMAT_KERNEL", "1" if request.param == "kernel" else "0")
    if request.param == "kernel" and format_kernel.kernel() is None:
        pytest.skip("the format kernel could not be built here (no compiler)")
    return request.param

"""Tests for common/devices.py and for the threads that must bind their CUDA device.

Regression: the current CUDA device is per thread and new threads start on GPU
0, so with ``drafter.device = "cuda:1"`` the fused LM-head kernel launched on
GPU 0 with GPU 1 pointers and the metric snapshot's event was recorded on GPU
0's stream. Every process and every thread that touches CUDA now calls
``use_device`` first. On the CPU, ``torch.cuda.set_device`` is replaced by a
recorder that notes which thread asked for which device; the thread entry
points themselves run for real (up to the point where they would need a GPU).
"""

from __future__ import annotations

import queue
import threading
import types

import pytest
import torch

from common import devices
from common.devices import fast_bf16, head_dtype, resolve_dtype, use_device
from common.streams import SideStream

GPU1 = torch.device("cuda", 1)


class _Stop(Exception):
    """Raised by a fake right after the line under test, to end an entry point early."""


@pytest.fixture
def set_device_calls(monkeypatch):
    calls: list[tuple[str, torch.device]] = []

    def record(device):
        calls.append((threading.current_thread().name, torch.device(device)))

    monkeypatch.setattr(torch.cuda, "set_device", record)
    return calls


def _in_thread(name: str, target, *args) -> None:
    """Run ``target`` on a fresh thread called ``name`` (a new thread: its current device is GPU 0)."""
    errors: list[BaseException] = []

    def run():
        try:
            target(*args)
        except _Stop:
            pass
        except BaseException as exc:  # re-raised on the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), f"{name} did not finish"
    if errors:
        raise errors[0]


def test_use_device_sets_only_indexed_cuda_devices(set_device_calls):
    use_device(torch.device("cpu"))
    use_device("cpu")
    use_device(torch.device("cuda"))  # bare "cuda": the current device, left as it is
    assert set_device_calls == []
    use_device(GPU1)
    use_device("cuda:0")
    assert [d for _, d in set_device_calls] == [GPU1, torch.device("cuda", 0)]


def test_head_dtype_keeps_the_wire_dtype_on_cuda_and_fp32_on_cpu():
    # The LM head used to be upcast to fp32 on the GPU: ~12 TFLOP per step on CUDA cores.
    assert head_dtype(torch.device("cpu"), torch.bfloat16) == torch.float32
    assert head_dtype("cpu", torch.float16) == torch.float32
    assert head_dtype(torch.device("cuda"), torch.bfloat16) == torch.bfloat16
    assert head_dtype(GPU1, torch.float16) == torch.float16
    assert head_dtype("cuda:0", torch.float32) == torch.float32


@pytest.mark.parametrize("avx512_bf16, amx, expected", [
    (True, False, "bfloat16"), (False, True, "bfloat16"), (False, False, "float32")])
def test_auto_dtype_is_bf16_only_on_a_cpu_that_computes_it_fast(monkeypatch, avx512_bf16, amx, expected):
    # On an AVX2-only CPU bf16 matmuls are emulated (about 4x slower than fp32): auto must not pick them there.
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert resolve_dtype("auto", "cpu") == expected
    assert fast_bf16(torch.device("cpu")) == (expected == "bfloat16")
    for explicit in ("float32", "bfloat16", "float16"):
        assert resolve_dtype(explicit, "cpu") == explicit


def test_auto_dtype_on_a_cuda_device_follows_its_bf16_support(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for supported, expected in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda supported=supported: supported)
        assert resolve_dtype("auto", GPU1) == expected


def test_receiver_thread_binds_its_device(set_device_calls, monkeypatch):
    from drafter_worker import data_plane

    # The receiver's stream stays a CPU no-op; everything else is the real thread.
    monkeypatch.setattr(data_plane, "SideStream", lambda device: SideStream(torch.device("cpu")))
    receiver = data_plane.Receiver(None, device=GPU1)
    receiver.start()
    receiver.stop()
    receiver.join(10)
    assert not receiver.is_alive()
    assert set_device_calls == [("receiver", GPU1)]


def test_drafter_main_thread_binds_its_device(set_device_calls, tmp_path):
    from common.config import load_config
    from drafter_worker.worker import DrafterWorker

    worker = DrafterWorker(load_config(None, [f'run.root_dir="{tmp_path}"']))
    worker.device = GPU1  # only bound, never used: the loop ends at its first round
    worker.request_stop()
    try:
        _in_thread("drafter-main", worker.run)
    finally:
        worker.close()
    assert worker.outcome == "stopped"
    assert set_device_calls == [("drafter-main", GPU1)]


def test_target_link_thread_binds_its_device(set_device_calls, monkeypatch):
    from common.transport import TransportError
    from target_server import link

    def no_store(*args, **kwargs):
        raise TransportError("no store in this test")

    monkeypatch.setattr(link, "connect_store", no_store)
    events: queue.Queue = queue.Queue()
    thread = link.DrafterLink(
        name="d1", transport="nccl", store_address=("127.0.0.1", 1), prefix="p", device=GPU1,
        timeout_s=1.0, weights=torch.zeros(1), events=events, local_host="127.0.0.1",
    )
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    assert events.get_nowait().kind == "failed"  # it ran on into the (failing) store connection
    assert set_device_calls == [("link-d1", GPU1)]


def _raising_cfg():
    class Cfg:
        def __getattr__(self, name):
            raise _Stop

    return Cfg()


def test_target_process_and_capture_thread_bind_their_device(set_device_calls):
    from target_server.server import TargetServer

    class Loaded:
        @property
        def pad_token_id(self):
            raise _Stop  # the capture loop's first read after the binding

    _in_thread("target-main", TargetServer.start, types.SimpleNamespace(device=GPU1, cfg=_raising_cfg()))
    _in_thread("capture", TargetServer._capture_loop, types.SimpleNamespace(device=GPU1, loaded=Loaded()))
    assert set_device_calls == [("target-main", GPU1), ("capture", GPU1)]


def test_use_device_is_what_the_entry_points_call(set_device_calls):
    # The tests above patch torch.cuda.set_device; this pins that use_device goes through it.
    devices.use_device(GPU1)
    assert set_device_calls == [(threading.current_thread().name, GPU1)]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_fused_loss_and_metrics_on_a_gpu_that_is_not_current():
    from drafter_worker.model.device_metrics import DeviceAccumulators
    from drafter_worker.model.lm_loss import lm_head_loss, triton_lm_head_loss

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 1)
    gen = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(64, 128, generator=gen).to(dev)
    w = torch.randn(1000, 128, generator=gen).to(dev, torch.bfloat16)
    labels = torch.randint(0, 1000, (64,), generator=gen).to(dev)
    weights = torch.ones(64, device=dev)
    got = triton_lm_head_loss(h, w, labels, weights)
    ref = lm_head_loss(h, w, labels, weights)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-3)
    acc = DeviceAccumulators(dev, {"x": (1, "sum")})
    acc.add("x", got[0].detach())
    assert acc.snapshot()
    torch.cuda.synchronize(dev)
    values = acc.poll()
    assert values is not None and values["x"][0] == pytest.approx(float(ref[0]), rel=1e-4)

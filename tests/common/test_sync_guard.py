"""Tests for common/sync_guard.py: the CPU emulation of the CUDA sync contract, and the CUDA mode itself."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from common.sync_guard import HostSyncError, allow, mark_host, sync_guard


def _if_tensor(t):
    if t:  # the read: Tensor.__bool__
        return 1
    return 0


# (case id, method the error must name, the planted read, line offset of the read in its function)
CASES = [
    ("item", "Tensor.item", lambda t: t.item(), 0),
    ("tolist", "Tensor.tolist", lambda t: t.tolist(), 0),
    ("bool", "Tensor.__bool__", lambda t: bool(t), 0),
    ("float", "Tensor.__float__", lambda t: float(t), 0),
    ("int", "Tensor.__int__", lambda t: int(t), 0),
    ("index", "Tensor.__index__", lambda t: [10, 11, 12, 13][t], 0),
    ("cpu", "Tensor.cpu", lambda t: t.cpu(), 0),
    ("numpy", "Tensor.numpy", lambda t: t.numpy(), 0),
    ("np.asarray", "Tensor.__array__", lambda t: np.asarray(t), 0),
    ("torch.nonzero", "torch.nonzero", lambda t: torch.nonzero(t), 0),
    ("Tensor.nonzero", "Tensor.nonzero", lambda t: t.nonzero(), 0),
    ("if t:", "Tensor.__bool__", _if_tensor, 1),
]
IDS = [c[0] for c in CASES]


def _snapshot():
    return dict(vars(torch.Tensor)), torch.nonzero


def _assert_restored(before):
    attrs, nonzero = before
    after = dict(vars(torch.Tensor))
    assert after.keys() == attrs.keys()
    assert all(after[k] is attrs[k] for k in attrs)
    assert torch.nonzero is nonzero
    assert "item" not in vars(torch.Tensor)  # inherited from the C base again, not a leftover wrapper


@pytest.mark.parametrize("name,method,read,offset", CASES, ids=IDS)
def test_planted_read_raises_naming_method_and_line(name, method, read, offset):
    t = torch.tensor(2)
    line = read.__code__.co_firstlineno + offset
    with pytest.raises(HostSyncError) as info:
        with sync_guard("cpu"):
            read(t)
    message = str(info.value)
    assert method in message
    assert f"test_sync_guard.py:{line}" in message
    if "nonzero" in method:
        assert "nonzero_static" in message  # the sync-free form is named


@pytest.mark.parametrize("name,method,read,offset", CASES, ids=IDS)
def test_same_read_works_outside_the_guard(name, method, read, offset):
    before = _snapshot()
    with sync_guard("cpu"):
        pass
    read(torch.tensor(2))  # no error, nothing left patched
    _assert_restored(before)


def test_values_are_right_outside_the_guard_after_one_was_used():
    with sync_guard("cpu"):
        pass
    t = torch.tensor([0.0, 3.0])
    assert t[1].item() == 3.0 and bool(t[1]) and int(t[1]) == 3 and float(t[1]) == 3.0
    assert t.tolist() == [0.0, 3.0] and torch.nonzero(t).tolist() == [[1]]


def test_methods_restored_exactly_after_exit_and_after_an_exception():
    before = _snapshot()
    with sync_guard("cpu"):
        assert "item" in vars(torch.Tensor)  # patched while active
        assert torch.nonzero is not before[1]
    _assert_restored(before)

    with pytest.raises(ValueError, match="boom"):
        with sync_guard("cpu"):
            raise ValueError("boom")
    _assert_restored(before)

    with pytest.raises(HostSyncError):
        with sync_guard("cpu"):
            torch.tensor(1.0).item()
    _assert_restored(before)


def test_nested_guards_restore_once_outermost_exits():
    before = _snapshot()
    with sync_guard("cpu") as outer:
        with sync_guard("cpu", mode="record") as inner:
            torch.tensor(1.0).item()  # the innermost guard decides
        assert len(inner.violations) == 1
        with pytest.raises(HostSyncError):
            torch.tensor(1.0).item()  # the outer one is active again
        assert outer.violations == []
    _assert_restored(before)


def test_record_mode_collects_violations_without_raising():
    t = torch.tensor([1.0, 0.0])
    with sync_guard("cpu", mode="record") as report:
        assert t[0].item() == 1.0  # the read still returns its value
        assert t.tolist() == [1.0, 0.0]
        if t[1]:
            pytest.fail("t[1] is zero")
    assert [v.method for v in report.violations] == ["Tensor.item", "Tensor.tolist", "Tensor.__bool__"]
    assert all(v.site.split(":")[0].endswith("test_sync_guard.py") for v in report.violations)
    assert all(v.function == "test_record_mode_collects_violations_without_raising" for v in report.violations)
    assert report.mode == "record" and report.device == torch.device("cpu")


def test_device_agnostic_ops_pass():
    x = torch.randn(4, 8, requires_grad=True)
    with sync_guard("cpu") as report:
        y = (x.to(torch.float64) * 2).sum()
        y.backward()
        z = x.detach().to("cpu")  # CPU -> CPU: not a device read unless strict
        torch.nonzero_static(x.detach() > 0, size=4)  # fixed-size: the allowed form
        torch.where(x > 0, x, 0.0).sum()
    assert report.violations == [] and z.shape == (4, 8)


def test_strict_cpu_copies_flags_to_cpu():
    t = torch.ones(3)
    with pytest.raises(HostSyncError, match=r"Tensor\.to\(cpu\)"):
        with sync_guard("cpu", strict_cpu_copies=True):
            t.to("cpu")
    with pytest.raises(HostSyncError, match=r"Tensor\.to\(cpu\)"):
        with sync_guard("cpu", strict_cpu_copies=True):
            t.to(device=torch.device("cpu"), dtype=torch.float64)
    with sync_guard("cpu", strict_cpu_copies=True) as report:
        t.to(torch.float64)  # dtype only
    assert report.violations == []


def test_torch_internal_reads_are_allowed_and_counted():
    # Tensor.__format__ (torch/_tensor.py) reads a 0-d tensor with .item(): torch's own code, so allowed.
    with sync_guard("cpu") as report:
        text = f"{torch.tensor(1.5):.2f}"
    assert text == "1.50"
    assert report.violations == []
    assert any(key.startswith("Tensor.item at ") and "_tensor.py" in key for key in report.torch_internal)


def test_allow_permits_reads_in_its_block_only():
    t = torch.tensor(4.0)
    with sync_guard("cpu"):
        with allow():
            assert t.item() == 4.0 and t.cpu().numpy().tolist() == 4.0
        with pytest.raises(HostSyncError):
            t.item()
    with allow():  # a no-op outside a guard
        assert t.item() == 4.0


def test_marked_host_buffers_and_their_views_pass():
    host = mark_host(torch.arange(6, dtype=torch.float32))
    other = torch.arange(6, dtype=torch.float32)
    with sync_guard("cpu"):
        assert host.numpy().tolist() == [0, 1, 2, 3, 4, 5]
        assert host[2:4].tolist() == [2.0, 3.0]
        assert host[5].item() == 5.0
        with pytest.raises(HostSyncError):
            other.numpy()


def test_mark_host_refuses_non_cpu_tensors():
    with pytest.raises(ValueError, match="only CPU tensors"):
        mark_host(torch.empty(2, device="meta"))


def test_other_threads_are_not_guarded():
    results: list[float] = []
    errors: list[BaseException] = []

    def reader():
        try:
            results.append(torch.tensor(7.0).item())
        except BaseException as exc:
            errors.append(exc)

    with sync_guard("cpu"):
        thread = threading.Thread(target=reader)
        thread.start()
        thread.join(timeout=10)
    assert not thread.is_alive() and errors == [] and results == [7.0]


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="raise' or 'record"):
        with sync_guard("cpu", mode="warn"):
            pass


# ---------------------------------------------------------------------------
# CUDA: the framework's sync debug mode is the authority
# ---------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_cuda_item_raises_and_mode_is_restored():
    before = torch.cuda.get_sync_debug_mode()
    t = torch.ones(4, device="cuda")
    with pytest.raises(HostSyncError, match="synchronizing CUDA operation"):
        with sync_guard(t.device):
            t.sum().item()
    assert torch.cuda.get_sync_debug_mode() == before
    with sync_guard(t.device):
        (t * 2).sum()  # device-only work passes
        with allow():
            assert t.sum().item() == 4.0
    assert torch.cuda.get_sync_debug_mode() == before


@pytest.mark.gpu
@needs_cuda
def test_cuda_record_mode_collects():
    t = torch.ones(4, device="cuda")
    with sync_guard("cuda", mode="record") as report:
        assert t.sum().item() == 4.0
    assert len(report.violations) >= 1 and report.violations[0].method == "cuda"

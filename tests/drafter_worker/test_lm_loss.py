"""The LM-head loss implementations against the plain reference ``drafter_worker.model.lm_loss.lm_head_loss``."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from drafter_worker.model import lm_loss
from drafter_worker.model.lm_loss import (
    chunked_lm_head_loss,
    fused_lm_head_loss,
    lm_head_loss,
    resolve_mode,
    triton_lm_head_loss,
)

# Odd sizes on purpose: nothing divides the chunk or tile sizes.
LEAD = (3, 13)  # 39 positions
HIDDEN = 48
VOCAB = 1000

ROOT = Path(__file__).resolve().parents[2]
HAS_TRITON = lm_loss.triton is not None
# Triton decides compiled vs interpreted when it decorates a kernel, and
# triton.language's own helpers (tl.sum, tl.max) are decorated when triton is
# imported, so TRITON_INTERPRET=1 must be in the environment before the first
# ``import triton``: the interpreted Triton tests run in a subprocess started
# by test_triton_kernel_in_interpreter_subprocess (or directly when the whole
# suite already runs with TRITON_INTERPRET=1).
INTERPRETED = HAS_TRITON and lm_loss._INTERPRETED
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
interpreted_only = pytest.mark.skipif(
    not INTERPRETED, reason="needs TRITON_INTERPRET=1 before import; run in a subprocess by the driver test"
)


def make_inputs(seed: int = 0, lead=LEAD, hidden=HIDDEN, vocab=VOCAB, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(*lead, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * (3.0 / math.sqrt(hidden))
    labels = torch.randint(0, vocab, lead, generator=gen)
    # Half the labels are the argmax, so hits are not all zero.
    best = (h @ w.T).argmax(-1)
    take = torch.rand(lead, generator=gen) < 0.5
    labels = torch.where(take, best, labels)
    weights = torch.rand(lead, generator=gen) + 0.1
    weights[..., ::4] = 0.0  # padding positions: weight 0 with valid (arbitrary) labels
    return h.to(dtype), w.to(dtype), labels, weights


def run(fn, h, w, labels, weights, *, train_head: bool, **kw):
    h = h.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(train_head)
    loss_sum, weight_sum, hits = fn(h, w, labels, weights, **kw)
    assert loss_sum.shape == () and weight_sum.shape == () and hits.shape == labels.shape
    assert hits.dtype == torch.float32 and not hits.requires_grad
    loss_sum.backward()
    return loss_sum.detach(), weight_sum, hits, h.grad, w.grad


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def assert_matches_reference(fn, *, train_head: bool, seed: int = 0, device: str = "cpu", **kw):
    h, w, labels, weights = (t.to(device) for t in make_inputs(seed))
    ref = run(lm_head_loss, h, w, labels, weights, train_head=train_head)
    got = run(fn, h, w, labels, weights, train_head=train_head, **kw)
    assert rel(got[0], ref[0]) < 1e-5
    assert torch.equal(got[1], ref[1])
    # Hits must agree exactly wherever the argmax is not a near-tie.
    top2 = (h @ w.T).topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 1e-4
    assert clear.float().mean() > 0.9
    assert torch.equal(got[2][clear], ref[2][clear])
    assert ref[2].sum() > 0  # the comparison covers hits as well as misses
    assert rel(got[3], ref[3]) < 1e-5
    # Padding positions (weight 0) get exactly no gradient.
    assert bool(torch.all(got[3][weights == 0] == 0))
    if train_head:
        assert rel(got[4], ref[4]) < 1e-5
    else:
        assert got[4] is None


@pytest.mark.parametrize("train_head", [False, True], ids=["frozen_head", "trained_head"])
@pytest.mark.parametrize("chunk_size", [97, 256, 4096], ids=lambda c: f"chunk{c}")
def test_chunked_matches_reference(train_head, chunk_size):
    assert_matches_reference(chunked_lm_head_loss, train_head=train_head, chunk_size=chunk_size)


TRITON_CASES = pytest.mark.parametrize(
    "kernel_kw",
    [dict(num_splits=1, block_n=16, block_v=64, block_h=32), dict(num_splits=3), dict(num_splits=None, block_v=256)],
    ids=["one_split", "three_splits", "default_splits"],
)


@interpreted_only
@pytest.mark.parametrize("train_head", [False, True], ids=["frozen_head", "trained_head"])
@TRITON_CASES
def test_triton_interp_matches_reference(train_head, kernel_kw):
    assert_matches_reference(triton_lm_head_loss, train_head=train_head, chunk_size=300, **kernel_kw)


@interpreted_only
def test_triton_interp_ties_and_no_grad():
    h, w, labels, weights = tied_inputs()
    ref_hits = lm_head_loss(h, w, labels, weights)[2]
    # One split: the twins 7 and 900 meet in different tiles of one program;
    # three splits: in different programs, merged on the host side.
    for splits in (1, 3):
        hits = triton_lm_head_loss(h, w, labels, weights, block_v=64, num_splits=splits)[2]
        assert hits[:2].tolist() == [0.0, 1.0], splits
        assert torch.equal(hits, ref_hits)
    h, w, labels, weights = make_inputs(seed=4)
    ref = lm_head_loss(h, w, labels, weights)
    with torch.no_grad():
        got = triton_lm_head_loss(h.requires_grad_(True), w, labels, weights, num_splits=2)
    assert got[0].grad_fn is None and rel(got[0], ref[0]) < 1e-5 and torch.equal(got[2], ref[2])
    empty = triton_lm_head_loss(h[:0], w, labels[:0], weights[:0])
    assert empty[0].item() == 0.0 and empty[2].shape == (0, LEAD[1])


def _assert_bf16_triton_matches_reference(*, loss_rtol: float, device: str = "cpu"):
    h, w, labels, weights = (t.to(device) for t in make_inputs(seed=1, dtype=torch.bfloat16))
    ref = run(lm_head_loss, h, w, labels, weights, train_head=False)
    got = run(triton_lm_head_loss, h, w, labels, weights, train_head=False, chunk_size=97, num_splits=3)
    assert got[3].dtype == torch.bfloat16
    assert rel(got[0], ref[0]) < loss_rtol
    top2 = (h.float() @ w.float().T).topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 0.1  # far beyond one bf16 ulp of the logits
    assert clear.float().mean() > 0.5 and torch.equal(got[2][clear], ref[2][clear])
    assert rel(got[3].float(), ref[3].float()) < 3e-2


@interpreted_only
def test_triton_interp_bf16_head_follows_reference():
    # On a GPU the drafter now keeps the target's bf16 LM head (it was upcast to
    # fp32: ~0.3-0.5 s of CUDA-core matmuls per step), so the kernel runs its dot
    # on bf16 inputs with fp32 accumulation. The interpreter rounds fp32 -> bf16
    # toward zero where GPUs round to nearest even, so here the logits may differ
    # by one bf16 ulp (a loss ~2e-5 apart here).
    _assert_bf16_triton_matches_reference(loss_rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
def test_triton_cuda_bf16_head_follows_reference():
    # Same fp32 accumulation as cuBLAS in another order: a logit may still land one
    # bf16 ulp apart at a rounding boundary, rarely.
    _assert_bf16_triton_matches_reference(loss_rtol=1e-3, device="cuda")


@needs_triton
def test_triton_kernel_in_interpreter_subprocess():
    if INTERPRETED:
        pytest.skip("this process already interprets Triton: the test_triton_interp_* tests ran directly")
    # One thread: the interpreter runs many tiny ops, which stall on a busy machine with more.
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)), "-k", "triton_interp"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("train_head", [False, True], ids=["frozen_head", "trained_head"])
@TRITON_CASES
def test_triton_cuda_matches_reference(train_head, kernel_kw):
    assert_matches_reference(triton_lm_head_loss, train_head=train_head, chunk_size=300, device="cuda", **kernel_kw)


def tied_inputs():
    """Rows whose maximal logit is shared by two vocabulary entries."""
    h, w, labels, weights = make_inputs(seed=3, lead=(4,))
    w = w.clone()
    # Row 0: tie between 5 and 6 (same tile / chunk); row 1: 7 and 900 (far apart:
    # different chunks and, with 3 splits, different Triton programs).
    for row, (a, b) in enumerate([(5, 6), (7, 900)]):
        w[a] = h[row] * 10.0
        w[b] = w[a]
    labels = torch.tensor([6, 7, labels[2], labels[3]])  # row 0 asks for the later twin
    return h, w, labels, weights


def test_ties_resolve_to_lowest_index_like_torch_argmax():
    h, w, labels, weights = tied_inputs()
    logits = h @ w.T
    assert logits[0, 5] == logits[0, 6] and logits[1, 7] == logits[1, 900]
    assert logits[:2].argmax(-1).tolist() == [5, 7]  # torch.argmax: first maximum
    ref_hits = lm_head_loss(h, w, labels, weights)[2]
    hits = chunked_lm_head_loss(h, w, labels, weights, chunk_size=128)[2]
    assert hits[:2].tolist() == [0.0, 1.0]
    assert torch.equal(hits, ref_hits)


def test_bf16_head_follows_reference_rounding():
    # The reference computes logits in the head's dtype (a bf16 head is never
    # copied to fp32); the chunked path must round the same way.
    h, w, labels, weights = make_inputs(seed=1, dtype=torch.bfloat16)
    ref = run(lm_head_loss, h, w, labels, weights, train_head=True)
    got = run(chunked_lm_head_loss, h, w, labels, weights, train_head=True, chunk_size=97)
    assert got[3].dtype == torch.bfloat16 and got[4].dtype == torch.bfloat16
    assert rel(got[0], ref[0]) < 1e-5
    assert torch.equal(got[2], ref[2])
    assert rel(got[3].float(), ref[3].float()) < 2e-2
    assert rel(got[4].float(), ref[4].float()) < 2e-2
    # Frozen head: the gradient folded into the forward pass, same rounding budget.
    got = run(chunked_lm_head_loss, h, w, labels, weights, train_head=False, chunk_size=97)
    assert rel(got[3].float(), ref[3].float()) < 2e-2


def test_scaled_upstream_gradient():
    # The loss is divided by the weight sum downstream: the backward must scale by grad_output.
    h, w, labels, weights = make_inputs(seed=2)
    grads = []
    for fn in (lm_head_loss, chunked_lm_head_loss):
        hh = h.clone().requires_grad_(True)
        loss_sum, weight_sum, _ = fn(hh, w, labels, weights)
        (loss_sum / weight_sum * 0.37).backward()
        grads.append(hh.grad)
    assert rel(grads[1], grads[0]) < 1e-5


def test_no_grad_returns_same_values_without_graph():
    h, w, labels, weights = make_inputs(seed=4)
    h.requires_grad_(True)
    ref = lm_head_loss(h, w, labels, weights)
    with torch.no_grad():
        got = chunked_lm_head_loss(h, w, labels, weights, chunk_size=97)
    assert got[0].grad_fn is None
    assert rel(got[0], ref[0].detach()) < 1e-5
    assert torch.equal(got[2], ref[2])


class MaxOutputNumel(TorchDispatchMode):
    """Largest output of any op run while active (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


@pytest.mark.parametrize("train_head", [False, True], ids=["frozen_head", "trained_head"])
def test_chunked_never_materialises_full_logits(train_head):
    # N > H so that the [V, H] weight (and its grad) is smaller than [N, V].
    n, chunk = 300, 128
    h, w, labels, weights = make_inputs(seed=5, lead=(n,))
    for fn, expect_full in ((lm_head_loss, True), (chunked_lm_head_loss, False)):
        hh = h.clone().requires_grad_(True)
        ww = w.clone().requires_grad_(train_head)
        kw = {} if fn is lm_head_loss else {"chunk_size": chunk}
        with MaxOutputNumel() as probe:
            loss_sum, _, _ = fn(hh, ww, labels, weights, **kw)
            loss_sum.backward()
        if expect_full:  # the probe does see the reference's logits
            assert probe.max_numel >= n * VOCAB
        else:
            assert probe.max_numel <= max(n * chunk, VOCAB * HIDDEN), probe.max_numel


def test_chunked_makes_no_host_syncs(monkeypatch):
    h, w, labels, weights = make_inputs(seed=6)
    h.requires_grad_(True)
    w.requires_grad_(True)

    def forbidden(*args, **kwargs):
        raise AssertionError("host sync in the fused loss")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    loss_sum, _, _ = chunked_lm_head_loss(h, w, labels, weights, chunk_size=97)
    loss_sum.backward()
    h.grad = None
    w.requires_grad_(False)
    loss_sum, _, _ = chunked_lm_head_loss(h, w, labels, weights, chunk_size=97)
    loss_sum.backward()
    monkeypatch.undo()
    assert math.isfinite(loss_sum.item())


def test_dispatch_modes():
    cpu = torch.device("cpu")
    assert resolve_mode(cpu) == "chunked"
    if lm_loss.triton is not None:
        cuda = torch.device("cuda")
        assert resolve_mode(cuda) == "triton"
        assert resolve_mode(cuda, rows=lm_loss.TRITON_MAX_ROWS) == "triton"
        # Past the measured crossover the chunked cuBLAS path is faster: auto takes it, an explicit mode stays.
        assert resolve_mode(cuda, rows=lm_loss.TRITON_MAX_ROWS + 1) == "chunked"
        assert resolve_mode(cuda, "triton", rows=lm_loss.TRITON_MAX_ROWS + 1) == "triton"
    assert resolve_mode(cpu, "torch") == "torch"
    with pytest.raises(ValueError, match="drafter.loss_impl"):
        resolve_mode(cpu, "fast")

    h, w, labels, weights = make_inputs(seed=7)
    ref = lm_head_loss(h, w, labels, weights)
    for mode in ("torch", "chunked", "auto"):
        got = fused_lm_head_loss(h, w, labels, weights, mode=mode)
        assert rel(got[0], ref[0]) < 1e-5 and torch.equal(got[2], ref[2])


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs triton imported without TRITON_INTERPRET")
def test_triton_refuses_cpu_tensors_without_interpreter():
    h, w, labels, weights = make_inputs(seed=8)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        fused_lm_head_loss(h, w, labels, weights, mode="triton")


def test_empty_input():
    h, w, labels, weights = make_inputs(seed=11, lead=(0,))
    h.requires_grad_(True)
    loss_sum, weight_sum, hits = chunked_lm_head_loss(h, w, labels, weights)
    loss_sum.backward()
    assert loss_sum.item() == 0.0 and weight_sum.item() == 0.0 and hits.shape == (0,)
    assert h.grad.shape == h.shape


def test_rejects_mismatched_shapes():
    h, w, labels, weights = make_inputs(seed=9)
    with pytest.raises(ValueError, match="leading dims"):
        chunked_lm_head_loss(h, w, labels[:, :-1], weights[:, :-1])
    with pytest.raises(ValueError, match="H ="):
        chunked_lm_head_loss(h[..., :-1], w, labels, weights)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_lm_head_loss(h, w, labels, weights, chunk_size=0)


def test_reference_formula_sanity():
    # Guards the reference itself against drift: CE from log_softmax by hand.
    h, w, labels, weights = make_inputs(seed=10, lead=(5,))
    logp = F.log_softmax(h @ w.T, dim=-1)
    expected = -(logp.gather(1, labels[:, None]).squeeze(1) * weights).sum()
    assert rel(chunked_lm_head_loss(h, w, labels, weights, chunk_size=97)[0], expected) < 1e-5

#!/usr/bin/env bash
# Data-plane pair checks on one GPU machine (sized for one H200: under 8 minutes in all).
#
#   Ran on one H200 on 2026-12-04 (torch 2.11 + CUDA 13.0, NCCL 2.28.9): every section
#   passed, exit 0 in 182 s; figures in docs/benchmarks.md. Not yet run on two GPUs.
#
#   bench/gpu_pair_check.sh              # from the repository root or anywhere
#   OUT=/some/dir bench/gpu_pair_check.sh
#
# Sections (each with its own time limit; a failed section does not stop the others):
#   1. versions        torch / CUDA / NCCL (torch.cuda.nccl.version()), GPUs with UUIDs, the
#                      NCCL error-handling env the transport sets (common/transport.py)
#   2. nccl-transfer   two processes, the real DrafterLink (target) and PairGroup + Receiver
#                      (drafter): 1 GiB weights, 64 batches of 16-128 MiB, each checked; then a
#                      send the drafter never receives must fail within the timeout and leave
#                      both processes alive. On two GPUs: target cuda:0, drafter cuda:1. On one
#                      GPU both use cuda:0: NCCL refuses that ("Duplicate GPU detected"), which
#                      the section records as SKIP provided the refusal arrives as a clean
#                      failure (no hang, no killed process); the target refuses such a drafter
#                      at HELLO anyway (transport.same_gpu_refusal). On one GPU the transfer then
#                      runs again with --host-id-split (nccl-transfer-hostid): each rank sets its
#                      own NCCL_HOSTID, so NCCL pairs them over its socket transport on loopback.
#   3. gloo-transfer   16 batches over gloo with CPU tensors (the path the CPU tests cover)
#   4. nccl-lonely-0   a target whose drafter never joins: TransportError within the timeout,
#                      then the process must stay alive (no watchdog / heartbeat-monitor kill)
#   5. nccl-lonely-1   the same for a drafter whose target never joins
# Output: $OUT/gpu_pair_check.log (everything) and $OUT/gpu_pair_check.tar.gz (per-section
# logs); OUT defaults to ./gpu-pair-out. Exit status: 0 when every section passed, 1 otherwise,
# 2 without a CUDA device.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-./gpu-pair-out}"
mkdir -p "$OUT/sections"
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/gpu_pair_check.log"
exec > >(tee "$LOG") 2>&1
SECTION_DIR="$OUT/sections"
source "$ROOT/bench/gpu_lib.sh"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"  # NCCL's own reason for a refusal lands in the section's log
# Install what the checks import when the machine lacks it (a bare device machine).
if ! "$PY" -c "import torch, zmq, msgpack" 2>/dev/null; then
    echo "installing missing packages (torch, pyzmq, msgpack) ..."
    "$PY" -m pip install -q torch pyzmq msgpack || echo "WARNING: pip install failed"
fi

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device visible: nothing to check here (the gloo paths are covered by tests/common/test_pair_errors.py)"
    exit 2
fi
NGPU="$("$PY" -c "import torch; print(torch.cuda.device_count())")"
DRAFTER_DEV="cuda:0"
if ((NGPU >= 2)); then DRAFTER_DEV="cuda:1"; fi
nvidia-smi -L || true

run versions 60 "$PY" bench/gpu_pair_check.py versions
run nccl-transfer 150 "$PY" bench/gpu_pair_check.py transfer --kind nccl --target-device cuda:0 \
    --drafter-device "$DRAFTER_DEV" --timeout-s 20 --stall
if ((NGPU < 2)); then
    # The same transfer with both ranks on the one GPU, each claiming its own NCCL host (socket transport).
    run nccl-transfer-hostid 150 "$PY" bench/gpu_pair_check.py transfer --kind nccl --target-device cuda:0 \
        --drafter-device cuda:0 --timeout-s 20 --stall --host-id-split
fi
run gloo-transfer 120 "$PY" bench/gpu_pair_check.py transfer --kind gloo --target-device cpu --batches 16 \
    --drafter-device cpu --timeout-s 30
run nccl-lonely-0 60 "$PY" bench/gpu_pair_check.py lonely --kind nccl --rank 0 --device cuda:0 --timeout-s 10
run nccl-lonely-1 60 "$PY" bench/gpu_pair_check.py lonely --kind nccl --rank 1 --device cuda:0 --timeout-s 10

echo
echo "=== summary (+$((SECONDS - STARTED))s) ==="
printf '%s\n' "${SUMMARY[@]}"
tar -czf "$OUT/gpu_pair_check.tar.gz" -C "$OUT" sections
echo "log: $LOG  archive: $OUT/gpu_pair_check.tar.gz"
exit "$FAILED"

#!/usr/bin/env bash
# GPU check on one CUDA device (sized for one H200: under 8 minutes in all).
#
#   bench/gpu_check.sh            # from the repository root or anywhere
#   OUT=/some/dir bench/gpu_check.sh
#
# Sections (each with its own time limit; a failed section does not stop the others):
#   1. environment   torch / CUDA / triton versions, nvidia-smi
#   2. sync          target capture steps and drafter train steps (with a metrics
#                    snapshot and its deferred poll) under sync_guard(cuda), i.e.
#                    torch.cuda.set_sync_debug_mode("error"); then the overlap check: capture
#                    || copy-out and receive || train on the pipeline's side streams
#                    against one stream, ordered by events only     (bench/gpu_check.py)
#      sync-recipe   the same sync check with configs/quality.toml's drafter (block 4, draft
#                    vocabulary, soft-target loss, sliding-window layer) on the 8B shape
#   3. fused-kernel  the GPU tests (pytest -m gpu): the Triton LM-head loss against the
#                    reference, side streams, the CUDA sync guard, device selection
#   4. fused-bench   python bench/fused_loss_bench.py --device cuda (peak memory and time)
#   5. throughput    capture and train-step tokens/s in bf16 on SmolLM2 (if its package is
#                    installed) and on a random Llama-8B-shaped few-layer model (bench/gpu_check.py)
# Every output goes under $OUT (default runs/gpu_check); a summary is printed at the end.
# Exit status: 0 when every section passed, 1 otherwise, 2 without a CUDA device.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/runs/gpu_check}"
mkdir -p "$OUT"
SECTION_DIR="$OUT"
source "$ROOT/bench/gpu_lib.sh"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

section "environment ($PY, OUT=$OUT)"
if ! "$PY" - <<'EOF' 2>&1 | tee "$OUT/environment.log"; then
import sys
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton not installed: the fused kernel tests will skip")
if not torch.cuda.is_available():
    sys.exit("no CUDA device visible to torch")
print("device", torch.cuda.get_device_name(0), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
EOF
    echo "gpu_check: no usable CUDA device; nothing to check" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv 2>/dev/null || true

run sync 150 "$PY" bench/gpu_check.py --device cuda --sections sync,overlap --targets smollm2,llama8b --steps 4 --out "$OUT/sync"
# The CPU recipe's drafter (block 4, draft vocabulary, soft-target loss, sliding window) on the 8B shape.
run sync-recipe 120 "$PY" bench/gpu_check.py --device cuda --sections sync --targets llama8b --steps 4 \
    --drafter-config configs/quality.toml --set drafter.num_key_value_heads=0 --out "$OUT/sync-recipe"
run fused-kernel 120 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/drafter_worker/test_lm_loss.py tests/common/test_streams.py tests/common/test_sync_guard.py tests/common/test_devices.py
run fused-bench 75 "$PY" bench/fused_loss_bench.py --device cuda --out "$OUT/fused_loss.json"
run throughput 135 "$PY" bench/gpu_check.py --device cuda --sections throughput --targets smollm2,llama8b --out "$OUT/throughput"

section "summary (${SECONDS}s in all)"
for line in "${SUMMARY[@]}"; do
    echo "  $line"
done
"$PY" - "$OUT" <<'EOF' || true
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for name in ("sync", "sync-recipe", "throughput"):
    path = out / name / "gpu_check.json"
    if not path.exists():
        print(f"  {name}: no result file")
        continue
    sys.path.insert(0, "bench")
    from gpu_check import summary
    print("\n".join("  " + line for line in summary(json.loads(path.read_text())).splitlines()))
path = out / "fused_loss.json"
if path.exists():
    r = json.loads(path.read_text())
    for name, m in r["methods"].items():
        extra = ""
        if "mem_ratio_vs_plain" in m:
            extra = f"  mem x{m['mem_ratio_vs_plain']:.3f} time x{m['time_ratio_vs_plain']:.2f} rel err {m['rel_err_loss']:.1e}"
        print(f"  fused loss {name:>8}: {m['time_s'] * 1e3:8.2f} ms  peak {m['peak_bytes'] / 2**20:8.1f} MiB{extra}")
EOF
exit "$FAILED"

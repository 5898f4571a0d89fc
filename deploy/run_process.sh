#!/usr/bin/env bash
# Start one process of the job in the foreground; systemd units and the tmux
# launcher both go through here, so a process starts the same way everywhere.
#
#   deploy/run_process.sh target | metrics | drafter ID
#
# The script ends in `exec`, so the Python process keeps this script's pid and
# receives SIGTERM directly (systemd's main pid, tmux's pane pid).
#
# Environment (the systemd environment file sets these; see deploy/systemd/dflash.env.example):
#   DFLASH_CONFIG                           job config (required)
#   DFLASH_VENV                             virtual environment (default: <repo>/.venv)
#   DFLASH_RUN_NAME                         overrides run.name when set
#   DFLASH_TARGET_CUDA_VISIBLE_DEVICES      CUDA_VISIBLE_DEVICES of the target
#   DFLASH_DRAFTER_<ID>_CUDA_VISIBLE_DEVICES  ... of drafter <ID> (characters other than
#                                           letters and digits in the id become _)
#   DFLASH_EXTRA_ARGS                       extra arguments for every process (e.g. --set ...)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
usage() { echo "usage: $0 target|metrics|drafter ID" >&2; exit 2; }
[ $# -ge 1 ] || usage
process=$1

VENV=${DFLASH_VENV:-$ROOT/.venv}
PY=$VENV/bin/python
if [ ! -x "$PY" ]; then
    echo "run_process.sh: no Python at $PY; set DFLASH_VENV to the virtual environment (or run 'make venv' in $ROOT)" >&2
    exit 2
fi
if [ -z "${DFLASH_CONFIG:-}" ]; then
    echo "run_process.sh: DFLASH_CONFIG is not set; point it at the job's TOML config" >&2
    exit 2
fi

args=(--config "$DFLASH_CONFIG")
if [ -n "${DFLASH_RUN_NAME:-}" ]; then
    args+=(--set "run.name=\"$DFLASH_RUN_NAME\"")
fi
# Word-split on purpose: DFLASH_EXTRA_ARGS="--set a.b=1 --set c.d=2".
# shellcheck disable=SC2206
extra=(${DFLASH_EXTRA_ARGS:-})

case "$process" in
    target)
        module=target_server
        devices=${DFLASH_TARGET_CUDA_VISIBLE_DEVICES:-}
        ;;
    metrics)
        module=metrics_sidecar
        devices=""
        ;;
    drafter)
        [ $# -eq 2 ] || usage
        drafter_id=$2
        module=drafter_worker
        args+=(--id "$drafter_id")
        var="DFLASH_DRAFTER_${drafter_id//[^A-Za-z0-9]/_}_CUDA_VISIBLE_DEVICES"
        devices=${!var:-}
        ;;
    *)
        usage
        ;;
esac
if [ -n "$devices" ]; then
    export CUDA_VISIBLE_DEVICES=$devices
fi
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"
exec "$PY" -m "$module" "${args[@]}" "${extra[@]}"

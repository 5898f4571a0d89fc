#!/usr/bin/env bash
# Start one process of the job in the foreground; systemd units and the tmux
# launcher both go through here, so a process starts the same way everywhere.
#
#   deploy/run_process.sh target [REPLICA] | metrics | drafter ID | drafter-group ID
#
#   target            the target (target.replicas = 1), or replica 0 of the config
#   target R          target replica R (dflash-target --replica R)
#   drafter ID        drafter ID as one process (dflash-drafter --id ID)
#   drafter-group ID  drafter ID trained by several ranks: torchrun --nproc-per-node N, N from
#                     len(drafter.devices) of [drafters.ID] (python -m deploy.node --run-group ID,
#                     which stays torchrun's parent and passes SIGTERM to the ranks)
#
# The script ends in `exec`, so the Python process keeps this script's pid and
# receives SIGTERM directly (systemd's main pid, tmux's pane pid).
#
# Environment (the systemd environment file sets these; see deploy/systemd/dflash.env.example):
#   DFLASH_CONFIG                           job config (required)
#   DFLASH_VENV                             virtual environment (default: <repo>/.venv)
#   DFLASH_RUN_NAME                         overrides run.name when set
#   DFLASH_TARGET_CUDA_VISIBLE_DEVICES      CUDA_VISIBLE_DEVICES of `target`
#   DFLASH_TARGET_<R>_CUDA_VISIBLE_DEVICES  ... of `target R` (the one above does not apply to replicas)
#   DFLASH_DRAFTER_<ID>_CUDA_VISIBLE_DEVICES  ... of drafter <ID>, one process or a torchrun group
#                                           (characters other than letters and digits in the id become _)
#   DFLASH_DRAFTER_<ID>_NPROC               drafter-group: ranks, instead of len(drafter.devices)
#   DFLASH_TORCHRUN_MAX_RESTARTS            drafter-group: torchrun --max-restarts (default 3)
#   DFLASH_EXTRA_ARGS                       extra arguments for every process (e.g. --set ...)
# Empty or unset: the process sees every GPU the caller does.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
usage() { echo "usage: $0 target [REPLICA] | metrics | drafter ID | drafter-group ID" >&2; exit 2; }
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
        [ $# -le 2 ] || usage
        module=target_server
        if [ $# -eq 2 ]; then
            replica=$2
            case "$replica" in ''|*[!0-9]*) echo "run_process.sh: the replica must be a number, got '$replica'" >&2; exit 2 ;; esac
            args+=(--replica "$replica")
            var="DFLASH_TARGET_${replica}_CUDA_VISIBLE_DEVICES"
            devices=${!var:-}
        else
            devices=${DFLASH_TARGET_CUDA_VISIBLE_DEVICES:-}
        fi
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
    drafter-group)
        [ $# -eq 2 ] || usage
        drafter_id=$2
        module=deploy.node
        args+=(--run-group "$drafter_id")
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

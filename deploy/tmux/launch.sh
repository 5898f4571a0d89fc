#!/usr/bin/env bash
# The whole job in one tmux session, one window per process (the Makefile's
# `tmux`, `restart-drafter`, `stop` and `logs` targets call this).
#
#   deploy/tmux/launch.sh [start] CONFIG          check the layout (python -m deploy.node --check), open the
#                                                 session: windows overview (dflash-status --watch over a pane
#                                                 tailing the sidecar log), metrics, target (target-<r> per
#                                                 replica when target.replicas > 1), drafter-<id>...
#   deploy/tmux/launch.sh restart-drafter CONFIG ID
#                                                 SIGTERM that drafter (all its ranks), wait for it to
#                                                 checkpoint and exit, start it again in its window;
#                                                 nothing else is touched
#   deploy/tmux/launch.sh stop CONFIG             SIGTERM drafters, then the target replicas, then the
#                                                 sidecar, waiting for each; then close the session
#   deploy/tmux/launch.sh logs CONFIG [PROCESS]   tail -F runs/<name>/logs/PROCESS.log (default metrics;
#                                                 e.g. target-2, drafter-g0.1 for rank 1 of g0)
#   deploy/tmux/launch.sh attach CONFIG
#
# Drafter ids are the config's [drafters.<id>] tables. A drafter whose table has
# drafter.devices with more than one entry runs as a torchrun group in its window
# (run_process.sh drafter-group: one rank per device); any other as one process.
# Each process starts through deploy/run_process.sh, so the variables it documents
# apply here too (DFLASH_VENV, DFLASH_RUN_NAME, DFLASH_*_CUDA_VISIBLE_DEVICES,
# DFLASH_DRAFTER_<ID>_NPROC, DFLASH_EXTRA_ARGS; DFLASH_NODE_HOST and
# DFLASH_NODE_DRAFTERS pick this host's part of a job spanning hosts);
# DFLASH_ENV_FILE=/etc/dflash/dflash.env reads them from the systemd environment file.
# DFLASH_TMUX_SESSION names the session (default dflash-<run name>),
# DFLASH_TMUX_SOCKET picks a separate tmux server (tmux -L), DFLASH_TMUX_ATTACH=0
# leaves the new session detached.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
RUNNER=$ROOT/deploy/run_process.sh
me=launch.sh

die() { echo "$me: $*" >&2; exit "${EXIT:-2}"; }
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | grep '^#' | sed 's/^# \{0,1\}//' >&2; exit 2; }

[ $# -ge 1 ] || usage
case "$1" in
    start|restart-drafter|stop|logs|attach) action=$1; shift ;;
    -h|--help) usage ;;
    *) action=start ;;
esac
[ $# -ge 1 ] || usage
[ -f "$1" ] || die "config file $1 does not exist"
CONFIG=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
shift

if [ -n "${DFLASH_ENV_FILE:-}" ]; then
    [ -r "$DFLASH_ENV_FILE" ] || die "cannot read DFLASH_ENV_FILE=$DFLASH_ENV_FILE"
    set -a
    # shellcheck disable=SC1090
    . "$DFLASH_ENV_FILE"
    set +a
fi
export DFLASH_CONFIG=$CONFIG
export DFLASH_VENV=${DFLASH_VENV:-$ROOT/.venv}
PY=$DFLASH_VENV/bin/python
[ -x "$PY" ] || die "no Python at $PY; run 'make venv' or set DFLASH_VENV"
cd "$ROOT"

overrides=()
if [ -n "${DFLASH_RUN_NAME:-}" ]; then
    overrides+=(--set "run.name=\"$DFLASH_RUN_NAME\"")
fi
info=$(PYTHONPATH="$ROOT" "$PY" -m tools.runinfo --config "$CONFIG" "${overrides[@]}") || exit 2
# RUN_NAME RUN_DIR CONTROL_ADDRESS DRAFTER_IDS TARGET_STOP_TIMEOUT_S DRAFTER_STOP_TIMEOUT_S
eval "$info"
node_tool() { PYTHONPATH="$ROOT" "$PY" -m deploy.node --config "$CONFIG" "${overrides[@]}" "$@"; }
info=$(node_tool --shell) || exit 2
# TARGET_REPLICAS NODE_REPLICAS (this host's) DRAFTER_NPROCS ("id:ranks ...", this host's) NODE_SIDECAR
eval "$info"
DRAFTER_IDS=""
for entry in $DRAFTER_NPROCS; do DRAFTER_IDS+="${DRAFTER_IDS:+ }${entry%:*}"; done
SESSION=${DFLASH_TMUX_SESSION:-dflash-${RUN_NAME//[^A-Za-z0-9_-]/_}}

if [ "$action" = logs ]; then
    log="$RUN_DIR/logs/${1:-metrics}.log"
    [ -e "$log" ] || echo "$me: $log does not exist yet; waiting for it (Ctrl-C to quit)" >&2
    exec tail -n 50 -F "$log"
fi

command -v tmux >/dev/null 2>&1 || die "tmux is not installed (Debian/Ubuntu: apt-get install tmux)"
tm() {
    if [ -n "${DFLASH_TMUX_SOCKET:-}" ]; then
        tmux -L "$DFLASH_TMUX_SOCKET" "$@"
    else
        tmux "$@"
    fi
}
has_session() { tm has-session -t "=$SESSION" 2>/dev/null; }
win() { echo "=$SESSION:=$1"; }
has_window() { tm list-windows -t "=$SESSION" -F '#{window_name}' 2>/dev/null | grep -qx -- "$1"; }
pane() { tm display-message -p -t "$(win "$1")" "$2"; }

# The tmux server keeps the environment it was started with, so a pane gets the
# variables that matter passed explicitly.
env_prefix() {
    local prefix="env" name
    while IFS= read -r name; do
        prefix+=" $(printf '%q' "$name=${!name}")"
    done < <(compgen -e | grep -E '^(DFLASH_|CUDA_|PYTORCH_|NCCL_|WANDB_|HF_|TRANSFORMERS_|OMP_|TORCH_|PATH$|HOME$)' || true)
    echo "$prefix"
}
process_cmd() {  # process [id]
    echo "exec $(env_prefix) $(printf '%q ' "$RUNNER" "$@")"
}

# Send SIGTERM to the live processes of the given windows, wait up to timeout_s
# for all of them, SIGKILL what is left. Prints one line per process.
stop_windows() {  # timeout_s window...
    local timeout_s=$1; shift
    local w pid live=() failed=0 start=$SECONDS
    for w in "$@"; do
        has_window "$w" || continue
        if [ "$(pane "$w" '#{pane_dead}')" = 1 ]; then
            echo "$me: $w had already exited (status $(pane "$w" '#{pane_dead_status}'))"
            continue
        fi
        pid=$(pane "$w" '#{pane_pid}')
        kill -TERM "$pid" 2>/dev/null || true
        live+=("$w")
    done
    while [ ${#live[@]} -gt 0 ]; do
        local still=()
        for w in "${live[@]}"; do
            local status=""
            if [ "$(pane "$w" '#{pane_dead}')" = 1 ]; then
                # The pane reads dead when its terminal closes, before tmux has reaped
                # the process. tmux (3.3a at least) sometimes misses the SIGCHLD and
                # leaves the process a zombie with no exit status; running any job
                # makes it wait for children again, and it reaps them all.
                status=$(pane "$w" '#{pane_dead_status}')
                if [ -z "$status" ]; then
                    tm run-shell true 2>/dev/null || true
                    status=$(pane "$w" '#{pane_dead_status}')
                fi
                if [ -z "$status" ] && [ "$(pane "$w" '#{pane_dead_signal}')" != "" ]; then
                    status="signal $(pane "$w" '#{pane_dead_signal}')"
                fi
            fi
            if [ -n "$status" ]; then
                echo "$me: $w exited with status $status after $((SECONDS - start))s"
                [ "$status" = 0 ] || failed=1
            else
                still+=("$w")
            fi
        done
        live=("${still[@]+"${still[@]}"}")
        [ ${#live[@]} -gt 0 ] || break
        if [ $((SECONDS - start)) -ge "$timeout_s" ]; then
            for w in "${live[@]}"; do
                echo "$me: $w did not exit within ${timeout_s}s of SIGTERM; sending SIGKILL" >&2
                kill -KILL "$(pane "$w" '#{pane_pid}')" 2>/dev/null || true
            done
            failed=1
            sleep 0.5
            break
        fi
        sleep 0.3
    done
    return $failed
}

drafter_windows() {
    local id
    for id in $DRAFTER_IDS; do echo "drafter-$id"; done
}
target_windows() {
    local r
    for r in $NODE_REPLICAS; do
        if [ "$TARGET_REPLICAS" = 1 ]; then echo target; else echo "target-$r"; fi
    done
}
drafter_nproc() {  # id
    local entry
    for entry in $DRAFTER_NPROCS; do
        if [ "${entry%:*}" = "$1" ]; then echo "${entry##*:}"; return; fi
    done
    echo 1
}
window_cmd() {  # window name -> the command its pane runs
    case "$1" in
        drafter-*)
            if [ "$(drafter_nproc "${1#drafter-}")" -gt 1 ]; then
                process_cmd drafter-group "${1#drafter-}"
            else
                process_cmd drafter "${1#drafter-}"
            fi
            ;;
        target-*) process_cmd target "${1#target-}" ;;
        *) process_cmd "$1" ;;
    esac
}

case "$action" in
start)
    if has_session; then
        EXIT=1 die "tmux session $SESSION is already running: attach with 'tmux attach -t $SESSION', stop it with 'make stop'"
    fi
    node_tool --check --quiet || die "the layout of $CONFIG cannot work (above); 'python -m deploy.node --config $CONFIG --check' lists every process"
    mkdir -p "$RUN_DIR/logs"
    status_cmd="exec $(env_prefix) PYTHONPATH=$(printf '%q' "$ROOT") $(printf '%q ' "$PY" -m tools.status --config "$CONFIG" "${overrides[@]}" --watch 2)"
    tail_cmd="exec tail -n 100 -F $(printf '%q' "$RUN_DIR/logs/metrics.log")"
    tm new-session -d -s "$SESSION" -n overview -x 200 -y 50 -c "$ROOT" "$status_cmd"
    tm split-window -v -l 70% -t "$(win overview)" -c "$ROOT" "$tail_cmd"
    # Start order: sidecar (sees every first record), target, drafters (they wait for the target anyway).
    windows=()
    if [ "$NODE_SIDECAR" = 1 ]; then windows+=(metrics); fi
    windows+=($(target_windows) $(drafter_windows))
    for w in "${windows[@]}"; do
        # A placeholder first, so remain-on-exit is set before the real process can exit:
        # a crashed process leaves its last lines on screen and its exit status for `stop`.
        tm new-window -d -t "=$SESSION:" -n "$w" -c "$ROOT" "exec sleep 2147483647"
        tm set-option -w -t "$(win "$w")" remain-on-exit on
        tm respawn-pane -k -t "$(win "$w")" -c "$ROOT" "$(window_cmd "$w")"
    done
    tm select-window -t "$(win overview)"
    echo "$me: tmux session $SESSION: windows overview, ${windows[*]}"
    echo "$me: run directory $RUN_DIR; attach with: tmux${DFLASH_TMUX_SOCKET:+ -L $DFLASH_TMUX_SOCKET} attach -t $SESSION"
    if [ "${DFLASH_TMUX_ATTACH:-1}" != 0 ] && [ -t 0 ] && [ -t 1 ]; then
        if [ -n "${TMUX:-}" ]; then
            tm switch-client -t "=$SESSION"
        else
            exec tmux ${DFLASH_TMUX_SOCKET:+-L "$DFLASH_TMUX_SOCKET"} attach -t "=$SESSION"
        fi
    fi
    ;;
restart-drafter)
    [ $# -eq 1 ] || die "usage: $me restart-drafter CONFIG ID (drafters: $DRAFTER_IDS)"
    id=$1
    w="drafter-$id"
    has_session || die "no tmux session $SESSION; start it with 'make tmux'"
    has_window "$w" || die "no window $w in session $SESSION (drafters: $DRAFTER_IDS)"
    old=$(pane "$w" '#{pane_pid}')
    ok=0
    stop_windows $((DRAFTER_STOP_TIMEOUT_S + 15)) "$w" || ok=1
    tm respawn-pane -k -t "$(win "$w")" -c "$ROOT" "$(window_cmd "$w")"
    echo "$me: $w restarted: pid $old -> $(pane "$w" '#{pane_pid}')"
    exit $ok
    ;;
stop)
    if ! has_session; then
        echo "$me: no tmux session $SESSION; nothing to stop"
        exit 0
    fi
    ok=0
    # Drafters first (they checkpoint and say BYE), then the target, then the sidecar
    # (so it records everyone's last window).
    # shellcheck disable=SC2046
    stop_windows $((DRAFTER_STOP_TIMEOUT_S + 15)) $(drafter_windows) || ok=1
    # shellcheck disable=SC2046
    stop_windows $((TARGET_STOP_TIMEOUT_S + 15)) $(target_windows) || ok=1
    stop_windows 45 metrics || ok=1
    # The overview panes (status, tail) end on SIGTERM; let tmux reap them before the session goes.
    if has_window overview; then
        for pid in $(tm list-panes -t "$(win overview)" -F '#{pane_pid}'); do
            kill -TERM "$pid" 2>/dev/null || true
        done
        for _ in $(seq 20); do
            has_window overview || break
            sleep 0.1
        done
    fi
    has_session && tm kill-session -t "=$SESSION"
    echo "$me: session $SESSION closed"
    exit $ok
    ;;
attach)
    has_session || die "no tmux session $SESSION; start it with 'make tmux'"
    exec tmux ${DFLASH_TMUX_SOCKET:+-L "$DFLASH_TMUX_SOCKET"} attach -t "=$SESSION"
    ;;
esac

# Shared by the GPU check scripts (sourced, not run): the interpreter, the environment,
# and `run`, which executes one section under a time limit and records its outcome.
# The caller sets ROOT, OUT and SECTION_DIR (where each section's log goes) first.

if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
elif [[ -x "$ROOT/.venv/bin/python" ]]; then
    PY="$ROOT/.venv/bin/python"
else
    PY="$(command -v python3 || command -v python)"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

STARTED=$SECONDS
declare -a SUMMARY=()
FAILED=0

section() {
    echo
    echo "=== [$(date +%T), +$((SECONDS - STARTED))s] $* ==="
}

# run NAME LIMIT_S COMMAND...: run with a time limit, log to $SECTION_DIR/NAME.log, show its tail,
# record the outcome (a line starting "SKIP", after an optional "[time pid] " prefix, marks a
# section that could not apply on this machine).
run() {
    local name="$1" limit="$2"
    shift 2
    section "$name (limit ${limit}s): $*"
    local start=$SECONDS rc=0 log="$SECTION_DIR/$name.log"
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1 || rc=$?
    tail -n 30 "$log"
    local outcome="ok"
    if ((rc == 124 || rc == 137)); then
        outcome="TIMED OUT after ${limit}s"
    elif ((rc != 0)); then
        outcome="FAILED (exit $rc)"
    elif grep -qE '(^|\] )SKIP' "$log"; then
        outcome="ok (skip: see log)"
    fi
    [[ "$outcome" == ok* ]] || FAILED=1
    SUMMARY+=("$(printf '%-16s %-28s %4ss  log %s' "$name" "$outcome" "$((SECONDS - start))" "$log")")
}

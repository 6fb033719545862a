# Two commands: `make demo` and `make test`. Both build .venv themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean sandbox-deps

# What engine confinement needs from the system (docs/security.md): bubblewrap,
# libseccomp (pyseccomp loads it) and setpriv (util-linux). Root installs what is
# missing; anyone else is told the one command to run.
SANDBOX_PKGS := bubblewrap libseccomp2 util-linux
sandbox-deps:
	@missing=""; \
	command -v bwrap >/dev/null 2>&1 || missing="$$missing bubblewrap"; \
	command -v setpriv >/dev/null 2>&1 || missing="$$missing util-linux"; \
	ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2' || missing="$$missing libseccomp2"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing engine sandbox packages:$$missing"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y $$missing || \
	      { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y $$missing; }; \
	  else \
	    echo "engine sandbox needs:$$missing; run: sudo apt-get install -y$$missing" >&2; exit 1; \
	  fi; \
	fi

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP) sandbox-deps
	$(BIN)/gpuvirt demo

# Two workers: most of a test's time is processes starting (a host's, its engines' and
# a plugin's interpreters and imports) and waiting on each other, so one worker keeps
# 0.75 of a CPU busy; on a 2-CPU VM two workers ran the suite in 8.5 minutes, against
# 13 in one. Tests share nothing but the machine (every host, socket, state directory
# and cgroup is its own). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: $(STAMP) sandbox-deps
	$(BIN)/ruff check src tests
	$(BIN)/lint-imports
	$(BIN)/pytest -q -n $(TEST_WORKERS)

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/lint-imports
	$(BIN)/ruff format --check src tests

bench: $(STAMP)
	$(BIN)/gpuvirt bench all --report bench/report

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info

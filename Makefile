# The two commands of the README: `make demo` and `make test` (`make test-fast`: the tier that starts
# no process and skips the slow tests, minutes instead of the suite's quarter hour). All create .venv
# on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

export OMP_NUM_THREADS ?= 1
# pytest-xdist workers for `make test` (one per core of the 2-core CI machine; files stay whole on a
# worker, so a module's shared gloo pool and captures are made once). TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2

.PHONY: demo test test-fast install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch is pinned to the CPU wheel this machine carries; installing it first keeps any
	# dependency from pulling a different (CUDA) build.
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[test]" "torch==2.13.0"
	touch $(STAMP)

install: $(STAMP)

# The import contract first (pyproject.toml, [tool.importlinter]): it names any import against the layers.
test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

# The fast tier: no test that starts processes (marker `gloo`) or takes more than ~10 s (`slow`);
# AUTOPAR_TEST_NO_PROCESSES makes a test that starts one anyway fail, naming itself (tests/conftest.py).
test-fast: $(STAMP)
	$(VENV)/bin/lint-imports
	AUTOPAR_TEST_NO_PROCESSES=1 $(PY) -m pytest -q -n $(TEST_WORKERS) -m "not gloo and not slow" --durations=15

demo: $(STAMP)
	$(PY) -m autopar demo

clean:
	rm -rf $(VENV)

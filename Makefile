# Two commands do everything on a fresh machine:
#   make run    build .venv from the pinned constraints, then `dvc repro` on the embedded default
#   make test   the same install, then the whole test suite (what CI runs)
# a quicker loop while working (the slow `dvc repro` pipeline tests left out):
#   make test-fast
# and one to look at the tracked runs:
#   make ui     the MLflow UI on http://127.0.0.1:$(UI_PORT) against the project's store
PYTHON ?= python3
VENV ?= .venv
BIN := $(abspath $(VENV))/bin
CONSTRAINTS := requirements/constraints.txt
STAMP := $(VENV)/.installed
# startup files that patch two libraries in every Python of the venv, `dvc` included (cellpath/io/import_hooks.py):
# pandas hands pyarrow local parquet paths (decision 0033); DVC's SSH remote checks host keys, forwards no agent (0048)
STARTUP_FILES := $(VENV)/.startup-files
MLFLOW_URI ?= sqlite:///mlflow.db
UI_PORT ?= 5000
# pytest-xdist workers for make test / test-fast (docs/decisions/0042); TEST_WORKERS=0 runs in one process
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadgroup
export PATH := $(BIN):$(PATH)

.PHONY: install run test test-fast ui bench clean-venv

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet pip==26.3  # pip 23's resolver backtracks for many minutes on this stack
	# torch and torchvision first, pinned together (timm imports torchvision; see docs/decisions/0001)
	$(BIN)/pip install --quiet -c $(CONSTRAINTS) torch torchvision
	$(BIN)/pip install --quiet -c $(CONSTRAINTS) -e ".[test]"
	$(BIN)/pip check
	touch $(STAMP)

$(STARTUP_FILES): $(STAMP) src/cellpath/io/import_hooks.py
	$(BIN)/python -c "from cellpath.io import native_parquet, ssh_remote; \
	print('wrote', native_parquet.write_startup_file(), ssh_remote.write_startup_file())"
	touch $(STARTUP_FILES)

install: $(STAMP) $(STARTUP_FILES)

run: install
	$(BIN)/dvc repro

# --durations: the slowest tests in every run's log, CI's included (the suite's 15-minute budget)
test: install
	@HF_HUB_OFFLINE=1 $(BIN)/python -m pytest $(XDIST) --durations=30 $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests (exit 5)"; fi; exit $$rc

test-fast: install
	@start=$$(date +%s); HF_HUB_OFFLINE=1 $(BIN)/python -m pytest $(XDIST) -m "not slow" $(PYTEST_ARGS); rc=$$?; \
	echo "make test-fast: $$(( $$(date +%s) - start )) s without the slow pipeline tests (make test runs them)"; \
	exit $$rc

# Loopback only: the UI has no authentication. Use another URI for a remote store: make ui MLFLOW_URI=...
ui: install
	$(BIN)/mlflow ui --backend-store-uri $(MLFLOW_URI) --host 127.0.0.1 --port $(UI_PORT)

bench: install
	$(BIN)/python benchmarks/bench_fetch_ingest.py

clean-venv:
	rm -rf $(VENV)

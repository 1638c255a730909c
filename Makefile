# Quick start: `make serve` and `make test` on a fresh machine, nothing installed by hand.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=
# pytest-xdist workers for `make test` (one per core of CI's 2-core machine); whole files go to
# one worker (--dist loadfile), so a module's server fixtures start once.
TEST_WORKERS ?= 2

.PHONY: install test serve lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Without CUDA take the CPU build of torch that lies on disk: an unpinned torch pulls a
	# multi-GB CUDA build.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(ARGS)

serve: $(STAMP)
	$(PY) -m corun.serve $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check corun kernels models tests invariance_tests experiments examples

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

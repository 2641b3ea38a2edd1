# Every target builds .venv on first use, installing fsdpkit with its dev extra under
# constraints.txt (torch pinned to 2.13.0 so pip never resolves a bare, CUDA-sized torch).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench lint clean chaos

$(STAMP): pyproject.toml constraints.txt
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/python -m pytest tests

bench: $(STAMP)
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/checkpoint.py
	$(BIN)/python bench/export.py

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples chaos

clean:
	rm -rf $(VENV) runs .pytest_cache

# Seeded fault injection (minutes to an hour; not part of `make test`). CHAOS_ARGS="--scale 0.1" for a quick run.
chaos: $(STAMP)
	$(BIN)/python chaos/run.py $(CHAOS_ARGS)

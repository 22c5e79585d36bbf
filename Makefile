# The two commands a newcomer needs: `make train` and `make test`. Both set the machine up first.
PYTHON  ?= python3
VENV    ?= .venv
PY      := $(VENV)/bin/python
CONFIG  ?= configs/maniskill.yaml
STAMP   := $(VENV)/.installed
# pytest options, e.g. `make test PYTEST_ARGS="-k transport"`
PYTEST_ARGS ?=
# test files run on this many workers at once (pytest-xdist; 0: one process, as plain pytest)
TEST_WORKERS ?= 2

.PHONY: setup train test bench docs clean interop-env

setup: $(STAMP)
	@bash launch/setup_vulkan.sh $(PY)

# The venv is rebuilt when the package metadata or the pinned versions change. torch is pinned and
# installed first: the pin takes a local CPU build where one is provided and the matching CUDA build
# elsewhere; an unpinned `torch` would pull a multi-GB CUDA build onto CPU machines. Everything else
# comes at the versions in constraints.txt, the set the tests last passed with.
$(STAMP): setup.cfg setup.py pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=68" wheel
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	@touch $@

# Demonstrations -> SFT -> asynchronous RL, each stage cached in runs/<experiment>: a second call
# continues where the first stopped. The pixel task: `make train CONFIG=configs/pixel_task.yaml`.
train: setup
	$(VENV)/bin/asyncvla pipeline $(CONFIG) $(ARGS)

# Whole files go to the workers (a file's fixtures run once), the slow ones first (tests/conftest.py).
test: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# lerobot 0.4.3 in an environment of its own, for tests/test_lerobot_interop.py (`make test` skips
# it, in one line, while this is absent). lerobot pins torch < 2.8 and torchvision < 0.23 (its PyAV
# decoding goes through torchvision.io.VideoReader, which later releases dropped), against our
# torch: so a second venv, ~6 GB (PyPI's CUDA builds of torch, which run on the CPU). A second,
# separately stamped step adds what lerobot[smolvla]==0.4.3 needs to build and run SmolVLA
# (transformers 4.57, num2words, draccus, einops, ...), for tests/interop/smolvla_side.py, which
# writes the golden SmolVLA fixtures in tests/golden/smolvla/.
INTEROP ?= .venv-interop
interop-env: $(INTEROP)/.installed $(INTEROP)/.installed-smolvla
$(INTEROP)/.installed:
	@test -x $(INTEROP)/bin/python || $(PYTHON) -m venv $(INTEROP)
	$(INTEROP)/bin/pip install -q torch==2.7.1 torchvision==0.22.1
	$(INTEROP)/bin/pip install -q --no-deps lerobot==0.4.3
	$(INTEROP)/bin/pip install -q "datasets>=4.0.0,<4.2.0" "huggingface-hub>=0.34.2,<0.36.0" pandas pillow \
		pyarrow av fsspec packaging accelerate
	@touch $@
$(INTEROP)/.installed-smolvla: $(INTEROP)/.installed
	$(INTEROP)/bin/pip install -q "transformers==4.57.6" "num2words>=0.5.14,<0.6.0" \
		"accelerate>=1.10.0,<2.0.0" "safetensors>=0.4.3,<1.0.0" "draccus==0.10.0" \
		"einops>=0.8.0,<0.9.0" "deepdiff>=7.0.1,<9.0.0" "termcolor>=2.4.0,<4.0.0" \
		"gymnasium>=1.1.1,<2.0.0" "jsonlines>=4.0.0,<5.0.0" "imageio>=2.34.0,<3.0.0" \
		"diffusers>=0.27.2,<0.36.0" "pyserial>=3.5,<4.0" "huggingface-hub>=0.34.2,<0.36.0"
	@touch $@

# Performance and learning figures beside their baselines and goals: one table, and the JSON in
# bench_results/bench.json (+ learning_model.csv / .png). On 2 CPU cores: the learning benchmark
# (4 arms x 5 seeds, each run until it reaches its target: ~2.5 hours) plus ~30 minutes, ~12 of them the fault
# suite; `make bench ARGS=--quick` takes ~55.
bench: setup
	$(PY) -m tests.benchmarks.run_all $(ARGS)

# The documentation site (mkdocs.yml, docs/) into site/, offline; --strict fails on a broken link.
docs: setup
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) $(INTEROP) runs bench_results site .pytest_cache *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

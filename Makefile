# splitserve: `make demo` runs the main job, `make test` runs the whole suite (about 45 min),
# `make test-fast` the tests that start no server process (about two minutes; tests/README.md).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# vLLM's CPU build on machines without CUDA, the CUDA build otherwise.
VLLM_EXTRA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)
# Headless Chromium for tests/bench/test_browser.py: Debian's `chromium` package, installed when
# missing (as root, as here and in CI); never a browser downloaded by a tool.
CHROMIUM := command -v chromium >/dev/null || { command -v apt-get >/dev/null || { echo "make install: \
	Chromium is missing and there is no apt-get here: install your system's chromium package \
	(tests/bench/test_browser.py needs it)" >&2; exit 1; }; \
	{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
	|| { echo "make install: apt-get could not install chromium (run as root)" >&2; exit 1; }; }

# Mooncake's transfer engine (the `mooncake` extra) links libibverbs: Debian's libibverbs1,
# installed when missing (as root, as here and in CI).
IBVERBS := ldconfig -p | grep -q libibverbs.so.1 || { command -v apt-get >/dev/null || { echo \
	"make install: libibverbs.so.1 is missing and there is no apt-get here: install your \
	system's libibverbs (--connector mooncake needs it)" >&2; exit 1; }; \
	{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 \
	>/dev/null; } || { echo "make install: apt-get could not install libibverbs1 (run as root)" \
	>&2; exit 1; }; }

.PHONY: install demo test test-fast lint docs clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[$(VLLM_EXTRA),nixl,mooncake,test,ray,docs]"
	# PyPI's builds of these do not match the pinned torch and break transformers' imports.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	@$(CHROMIUM)
	@$(IBVERBS)
	touch $(STAMP)

install: $(STAMP)
	@$(CHROMIUM)
	@$(IBVERBS)

demo: $(STAMP)
	$(VENV)/bin/splitserve demo

test: $(STAMP)
	$(PY) -m ruff check splitserve tests benchmarks
	$(PY) -m mypy
	$(MAKE) docs
	$(PY) -m pytest -x -q -p no:cacheprovider --durations=30 tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not integration" tests

lint: $(STAMP)
	$(PY) -m ruff check splitserve tests benchmarks
	$(PY) -m mypy

# The documentation site (mkdocs.yml): strict, so a broken link or a page left out of the nav fails
# (never with -q: mkdocs then drops the warnings before strict mode counts them).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict -d site

clean:
	rm -rf $(VENV) .splitserve demo-results

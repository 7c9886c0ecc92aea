# tmt: every target sets itself up on a fresh machine (a virtual environment in .venv).
# TORCH is the pip requirement installed before the package: the default is the local CPU wheel;
# a GPU machine passes e.g. TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128".
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
STAMP := $(VENV)/.installed

.PHONY: install test test-slow test-reliability test-browser lint format docs demo finetune distill bench clean

install: $(STAMP)

# torch first and pinned: an open torch requirement resolved by pip would pull CUDA packages.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

# make test runs the suite in workers of one thread each (pytest-xdist; an idle worker takes
# tests queued for the other): the tests' small models keep a core busy with Python more than
# with arithmetic, so two one-thread workers beat one two-thread process (258 s against 390-470 s
# on the 2-core CI machine; 290 s with a file per worker). TEST_WORKERS=0 runs it in this process.
# The suite's processes write bytecode, whatever PYTHONDONTWRITEBYTECODE says: without it, each of
# its processes compiles tmt and the tests anew (collecting them took 10.7 s against 4.3 s).
TEST_WORKERS ?= auto
TEST_THREADS ?= 1
test: install
	env -u PYTHONDONTWRITEBYTECODE OMP_NUM_THREADS=$(TEST_THREADS) $(BIN)/python -m pytest -q \
		-n $(TEST_WORKERS) --maxprocesses 4 \
		--dist worksteal -m "not slow and not gpu and not browser"

test-slow: install
	$(BIN)/python -m pytest -q -m slow

# What .ci/run adds to make test: the fault matrix's longer checks (kills at 20 byte offsets, a
# stalled rank, ...: docs/reliability.md) and the end-to-end repeats of promises make test keeps
# with a faster test (each names it). Not here, in test-slow only: torch.compile, the reverse task
# trained to BLEU 90 and tmt terms on a million pairs (minutes each: benchmarks more than tests).
test-reliability: install
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -m slow \
		-k "not torch_compile and not reaches_bleu_90 and not on_a_million_pairs"

# The page of tmt serve in a real browser: Debian's chromium and chromium-driver (installed here if
# missing, from the distribution's packages; nothing is downloaded at run time), driven by selenium.
test-browser: install
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		{ $(SUDO) apt-get install -y -q chromium chromium-driver || \
		  { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium chromium-driver; }; }
	$(BIN)/python -m pytest -q -m browser

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

# The manual: docs/ as a site in site/ (its configuration reference made from the config first).
docs: install
	$(BIN)/python scripts/config_reference.py
	$(BIN)/python -m mkdocs build --strict

demo: install
	bash scripts/demo.sh

# Fine-tuning end to end: a parent on 10k Multi30k pairs, children with --init-from, BLEU of each.
finetune: install
	bash scripts/finetune.sh

# Fast students: a teacher, a deep-encoder shallow-decoder student on references and one distilled
# from the teacher (tmt distill), each 2,100 updates; BLEU, chrF and speed of all (docs/benchmarks.md).
distill: install
	bash scripts/distill.sh

bench: install
	$(BIN)/python -m pip install --quiet -e ".[bench]"
	$(BIN)/python scripts/bench_data.py
	$(BIN)/python scripts/bench_train.py
	test -d runs/bench_decode/average || $(BIN)/tmt train --set model.pre_norm=false \
		--set train.max_minutes=10 --set train.out_dir=runs/bench_decode
	$(BIN)/python scripts/bench_decode.py --checkpoint runs/bench_decode/average

clean:
	rm -rf runs/ site/ .pytest_cache .ruff_cache .hypothesis

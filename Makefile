# The README's two commands. Both set everything up from a fresh clone.
# Settings are given on make's command line (`make serve CONFIG=my.yaml`), never taken from the
# shell's environment: a CONFIG or PYTHON exported for something else changed what ran.
PYTHON = python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL := .cache/models/tiny-llama
CONFIG = deployments/configs/local.yaml
# Elsewhere than this machine, torch's CPU wheel comes from PyTorch's index:
#   make PIP_EXTRA="--extra-index-url https://download.pytorch.org/whl/cpu" test
PIP_EXTRA =

.PHONY: setup serve test test-slow bench bench-quick clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(PIP_EXTRA) -e '.[cpu,dev]'
	# PyPI's torchvision family fails to import beside the CPU torch and breaks transformers.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

$(MODEL)/config.json: $(STAMP) pools/tiny_model.py
	$(BIN)/poolserve make-tiny-model $(MODEL)

setup: $(STAMP) $(MODEL)/config.json

serve: setup
	$(BIN)/poolserve serve $(CONFIG)

test: setup
	$(BIN)/python -m pytest

test-slow: setup
	$(BIN)/python -m pytest -m slow

bench: setup
	$(BIN)/python -m bench.run_all

bench-quick: setup
	$(BIN)/python -m bench.run_all --quick

clean:
	rm -rf $(VENV) .cache

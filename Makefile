# The two commands of the README. Each installs what it needs first, so both work on a fresh clone.
PY ?= python3
PIP = $(PY) -m pip install --quiet
NOTEBOOKS = notebooks solutions

.PHONY: course test install doctor exercises

install:
	$(PIP) -e ".[course,dev]"

# Install, then open JupyterLab at chapter 00 (the bundled CPU model runs when no GPU or hub is there).
# JupyterLab refuses to start as root unless told; containers often run as root, so say it for them.
LAB_FLAGS = $(if $(filter 0,$(shell id -u 2>/dev/null)),--allow-root,)
course: install
	$(PY) -m jupyter lab $(LAB_FLAGS) notebooks/00_model_and_generation.ipynb

# Install, then run the whole suite: unit tests, then every notebook executed and checked by nbval.
test: install
	$(PY) -c "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports())"  # the import contracts (pyproject.toml)
	$(PY) -m pytest -n 2 --dist loadfile tests
	$(PY) -m pytest -n 2 --dist loadfile --nbval-lax --nbval-sanitize-with tests/nbval_sanitize.cfg -p no:randomly $(NOTEBOOKS)

doctor:
	$(PY) -m minifer doctor

# Regenerate exercises/ and solutions/ from their single source.
exercises:
	$(PY) tools/build_exercises.py

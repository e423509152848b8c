# The two commands of the README. Each installs what it needs first, so both work on a fresh clone.
# Without make (Windows, or a machine without it), docs/install.md gives the same steps as commands.
PY ?= python3
PIP = $(PY) -m pip install --quiet
# The chapters under nbval. The solutions run once, in the unit tests (tests/course/test_exercises.py executes each
# with errors refused and its check cells compared with the stored ones), so nbval does not run them a second time.
NOTEBOOKS = notebooks

# Where torch comes from when none is installed yet. On Linux PyPI's torch is the CUDA build (several GB of
# NVIDIA libraries, unused on a laptop), so the default is PyTorch's CPU wheels; macOS and Windows get CPU
# builds from PyPI anyway. A GPU machine: `make course TORCH_INDEX=https://download.pytorch.org/whl/cu128`,
# or TORCH_INDEX= (empty) for PyPI's default build. An installed torch in pyproject's range is kept.
TORCH_INDEX ?= $(if $(filter Linux,$(shell uname -s 2>/dev/null)),https://download.pytorch.org/whl/cpu,)
TORCH_SPEC := $(shell sed -n 's/^ *"\(torch[<>=!~][^"]*\)",.*/\1/p' pyproject.toml)
# CI pins every package to what it tested (constraints/ci.txt); a learner's install floats within pyproject's ranges.
CONSTRAINTS ?=
PIP_C = $(PIP) $(if $(CONSTRAINTS),-c $(CONSTRAINTS),)

.PHONY: course test test-core install install-course torch doctor exercises constraints wheelhouse results slides release hosted

# pip reads no index when the installed torch already satisfies the range, so this is a no-op then.
torch:
	$(if $(TORCH_INDEX),$(PIP_C) "$(TORCH_SPEC)" --index-url $(TORCH_INDEX),@true)

install-course: torch
	$(PIP_C) -e ".[course]"

install: torch
	$(PIP_C) -e ".[course,dev]"

# Install the course's needs only, then open JupyterLab at chapter 00 with the repository as its root, so that
# exercises/ and solutions/ are in its file browser (the bundled CPU models run when no GPU or hub is there).
# JupyterLab refuses to start as root unless told; containers often run as root, so say it for them.
LAB_FLAGS = $(if $(filter 0,$(shell id -u 2>/dev/null)),--allow-root,)
course: install-course
	$(PY) -m jupyter lab $(LAB_FLAGS) --ServerApp.root_dir=. notebooks/00_model_and_generation.ipynb

# Install, then run the whole suite: unit tests, every notebook executed and checked by nbval, then the course without
# Triton (NO_TRITON, below).
test: install
	$(PY) -c "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports())"  # the import contracts (pyproject.toml)
	$(PY) -m pytest -n 2 --dist loadfile tests
	$(PY) -m pytest -n 2 --dist loadfile --nbval-lax --nbval-sanitize-with tests/nbval_sanitize.cfg -p no:randomly $(NOTEBOOKS)
	MINIFER_NO_TRITON_STEP=1 PYTHONPATH=$(CURDIR)/tools/no_triton $(PY) -m pytest -n 2 --dist load -p no:randomly $(NO_TRITON)

# The course on a machine without Triton, played by Linux: tools/no_triton's sitecustomize hides the installed Triton
# from every process. The notebooks that use Triton (found by tools/no_triton/scan.py) run whole, every Triton cell
# saying why it skipped; the others run their first code cell. Proves Linux without Triton, not macOS or Windows.
NO_TRITON = tests/no_triton/test_notebooks_without_triton.py

# The core tier: the engine's guarantees in under a minute, to run on every change (tests/README.md).
test-core:
	$(PY) -m pytest -m core -q

doctor:
	$(PY) -m minifer_course.doctor

# Regenerate exercises/ and solutions/ from their single source.
exercises:
	$(PY) tools/build_exercises.py

# Lecture slides (reveal.js) from every chapter's stored outputs into build/slides/; the chapters are not edited:
# tools/make_slides.py derives each slide from the headings on a copy (docs/instructor-guide.md, "Slides").
slides:
	$(PY) tools/make_slides.py

# The hosted notebooks' badges and setup cell, from pyproject's [project.urls] Repository and version.
hosted:
	$(PY) tools/stamp_hosted.py

# Tag a release (what a hosted notebook installs) and write its CHANGELOG.md entry: make release [VERSION=0.2.0]
release:
	$(PY) tools/release.py $(VERSION)

# Re-run every CPU benchmark the chapters cite, at a clean commit, then re-execute the notebooks (hours on
# 2 cores). One part: make results ONLY="speculative kv_quant"; the list: python3 tools/make_results.py --list
results: install
	$(PY) tools/make_results.py $(if $(ONLY),--only $(ONLY),)

# Re-pin constraints/ci.txt to this environment (after the suite passed in it).
constraints:
	$(PY) tools/pin_constraints.py

# An offline wheelhouse for a room without a network: build once, hand out the folder (docs/install.md, "offline").
wheelhouse:
	bash scripts/build_wheelhouse.sh wheelhouse

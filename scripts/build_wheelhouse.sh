#!/usr/bin/env bash
# Build an offline wheelhouse once, hand it out (USB stick, a shared folder), install without a network:
#
#   bash scripts/build_wheelhouse.sh wheelhouse             # on a machine with a network
#   pip install --no-index --find-links wheelhouse -e ".[course]"   # on each laptop, from the repository clone
#
# It holds every wheel `minifer[course]` needs, torch's CPU build (from PyTorch's CPU index: no CUDA
# libraries), and setuptools for the editable install's build step. Wheels are per platform and Python
# version: build it on (or for) each kind of laptop in the room, e.g. one Linux x86-64 / Python 3.11 folder
# and one macOS arm64 folder.
#
# Environment: TORCH_INDEX (default PyTorch's CPU index; empty: PyPI's default build), TORCH_WHEEL (a torch
# wheel file already on disk, used instead of downloading one), EXTRAS (default "course"; "course,dev" adds
# what `make test` needs).
set -euo pipefail
out=${1:?usage: build_wheelhouse.sh OUT_DIR}
cd "$(dirname "$0")/.."
PY=${PY:-python3}
TORCH_INDEX=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}
EXTRAS=${EXTRAS:-course}
spec=$(sed -n 's/^ *"\(torch[<>=!~][^"]*\)",.*/\1/p' pyproject.toml)
mkdir -p "$out"
if [ -n "${TORCH_WHEEL:-}" ]; then
  cp "$TORCH_WHEEL" "$out/"
elif [ -n "$TORCH_INDEX" ]; then
  $PY -m pip download --quiet --no-deps --dest "$out" "$spec" --index-url "$TORCH_INDEX"
else
  $PY -m pip download --quiet --no-deps --dest "$out" "$spec"
fi
# Pin torch to the wheel just fetched, so the resolution below cannot prefer another build of it.
torch_version=$(ls "$out"/torch-*.whl | sed -n 's/.*torch-\([^-]*\)-.*/\1/p' | sort -V | tail -1)
pin=$(mktemp); trap 'rm -f "$pin"' EXIT
echo "torch==$torch_version" > "$pin"
$PY -m pip download --quiet --dest "$out" --find-links "$out" -c "$pin" ".[${EXTRAS}]" "setuptools>=69" wheel
rm -f "$out"/minifer-*  # the course installs minifer itself from the clone (editable)
echo "wheelhouse $out: $(ls "$out" | wc -l) files, $(du -sh "$out" | cut -f1), torch $torch_version"

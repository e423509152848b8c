#!/usr/bin/env bash
# The run that produced the shipped pair: the stages of train_pair.py, with the two target variants
# trained side by side on one GPU (a 9.5M-parameter model leaves an H200 mostly idle).
# Usage: bash scripts/train_pair_gpu.sh OUT_DIR
set -euo pipefail
out=${1:?usage: train_pair_gpu.sh OUT_DIR}
here=$(dirname "$0")
python3 "$here/train_pair.py" --only tokenizer --out "$out"
for p in 0.3 0.4; do
  python3 "$here/train_pair.py" --only target --tokenizer "$out/_tokenizer" --target-dropout $p --out "$out/d$p" \
    > "$out/target_d$p.log" 2>&1 &
done
wait
best=$(python3 - "$out" <<'PY'
import json, sys, pathlib
runs = {p: json.loads((pathlib.Path(sys.argv[1]) / f"d{p}" / "tinystories-target" / "training.json").read_text())
        for p in ("0.3", "0.4")}
print(min(runs, key=lambda p: runs[p]["best_val_loss"]))
PY
)
echo "target: keeping dropout $best"
rm -rf "$out/tinystories-target" && mv "$out/d$best/tinystories-target" "$out/tinystories-target"
python3 "$here/train_pair.py" --only draft --tokenizer "$out/_tokenizer" --teacher "$out/tinystories-target" --out "$out"

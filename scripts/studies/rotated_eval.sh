#!/bin/bash
# Rotated targets, the rows that need no training (docs/results.md, "Rotated targets"):
# the 16-bit recipe's draft (BASE: a run of scripts/studies/quant_alignment.py's `base` part) as it
# is and with the rotation folded (`specft fold-rotation`) on the rotated W8A8 target, and
# as it is on the unrotated W8A8 target; 128 held-out prompts per set, k = 3, 4, 5, batch 16,
# the same eval arguments as quant_alignment.py's `-eval` parts. Every eval resumes (a
# finished one is skipped); OUT/summary.{md,json} are written at the end.
#
#   BASE=runs/ckpt_study/base-bf16 OUT=runs/rotated bash scripts/studies/rotated_eval.sh
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd)
DATA=${DATA:-$REPO/../shared/data}
OUT=$(realpath -m "${OUT:-runs/rotated}")
BASE=$(realpath -m "${BASE:?the baseline run dir (quant_alignment.py --parts base)}")
ROTATED=${ROTATED:-w8a8_int8_quarot}
PLAIN=${PLAIN:-w8a8_int8}
FOLD=$OUT/base-folded-$ROTATED
mkdir -p "$OUT"
run() {  # quant data path val_fraction drafts labels
  local out=$OUT/eval-$1-$2-b16
  [ -f "$out/results.json" ] && { echo "[skip] $out"; return; }
  echo "[run] $out $(date)"
  python -m specft.cli eval model=smollm2_135m quant="$1" data="$2" data.path="$3" data.split=validation \
    data.val_fraction="$4" eval.num_prompts=128 eval.max_new_tokens=64 'eval.k=[3,4,5]' 'eval.batch_sizes=[16]' \
    "eval.drafts=[$5]" "eval.labels=[$6]" eval.target_alone=false eval.out_dir="$out" \
    run_dir="$OUT/evalrun-$1-$2" >> "$OUT/commands.log" 2>&1 || { echo "[failed] $out: see $OUT/commands.log"; exit 1; }
}
[ -f "$FOLD/draft.safetensors" ] || python -m specft.cli fold-rotation "$BASE" "$FOLD" --rotation "$ROTATED" || exit 1
G=$DATA/gsm8k/train.jsonl S=$DATA/sharegpt_sample/conversations.json
run "$ROTATED" gsm8k "$G" 0.1 "$BASE,$FOLD" baseline_16bit,baseline_folded
run "$PLAIN" gsm8k "$G" 0.1 "$BASE" baseline_16bit
run "$ROTATED" sharegpt "$S" 0.3 "$BASE,$FOLD" baseline_16bit,baseline_folded
run "$PLAIN" sharegpt "$S" 0.3 "$BASE" baseline_16bit
python "$REPO/scripts/studies/quant_alignment.py" --out-dir "$OUT" --parts ''

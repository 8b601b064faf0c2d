#!/usr/bin/env bash
# Issue 31's latency table on one accelerator, where batch 16-48 decoding is memory-bound
# (on a 2-core CPU it is compute-bound and says little about the brief's aim): the SmolLM2
# MXFP4 target alone, with the usual recipe's draft (16-bit EAGLE-3) and with specft's
# drafters, at batch 1, 16 and 48, k = 3..5. Two `specft eval` calls: batch 1 on a few
# prompts (sequential decoding), batches 16 and 48 on enough prompts to fill them. Each
# writes results.json (per-prompt counts, ms per token, memory) and results.md under OUT.
#
#   bash scripts/benchmarks/gpu_bench.sh RUNS_DIR [OUT]
#
# RUNS_DIR holds scripts/studies/parallel_drafters.py's run dirs (eagle3-bf16 = the usual recipe,
# eagle3-mxfp4, peagle-*, dflash-*); those present are benched. Needs specft installed
# (`make install`) and its data: the prompts are held-out GSM8K (DATA_PATH). Knobs, as
# environment variables: DEVICE (cuda), MODEL_ARGS ("model=smollm2_135m quant=mxfp4"),
# KS (3,4,5), BATCHES (16,48), PROMPTS (48), PROMPTS_B1 (8), TOKENS (64), DATA_PATH.
# A CPU dry run on tiny models: DEVICE=cpu MODEL_ARGS="model=tiny_qwen3 ..." PROMPTS=4 ...
set -euo pipefail
RUNS=${1:?usage: gpu_bench.sh RUNS_DIR [OUT]}
OUT=${2:-gpu_bench}
DEVICE=${DEVICE:-cuda}
MODEL_ARGS=${MODEL_ARGS:-model=smollm2_135m quant=mxfp4}
KS=${KS:-3,4,5}
BATCHES=${BATCHES:-16,48}
PROMPTS=${PROMPTS:-48}
PROMPTS_B1=${PROMPTS_B1:-8}
TOKENS=${TOKENS:-64}
DATA_PATH=${DATA_PATH:-$(cd "$(dirname "$0")/../../.." && pwd)/shared/data/gsm8k/train.jsonl}

drafts=() labels=()
for name in eagle3-bf16 eagle3-mxfp4 peagle-bf16 peagle-mxfp4 dflash-bf16 dflash-mxfp4; do
    if [ -e "$RUNS/$name/checkpoints/final/draft.safetensors" ]; then
        drafts+=("$(cd "$RUNS/$name" && pwd)")
        labels+=("$name")
    fi
done
if [ ${#drafts[@]} -eq 0 ]; then
    echo "error: no trained draft under $RUNS (eagle3-bf16, peagle-mxfp4, ...)" >&2
    exit 2
fi
join() { local IFS=,; echo "$*"; }

bench() {  # $1: out dir, $2: batch sizes, $3: prompts
    # shellcheck disable=SC2086  # MODEL_ARGS holds several overrides
    python -m specft.cli eval $MODEL_ARGS data=gsm8k "data.path=$DATA_PATH" data.split=validation \
        data.val_fraction=0.1 "eval.drafts=[$(join "${drafts[@]}")]" "eval.labels=[$(join "${labels[@]}")]" \
        "eval.k=[$KS]" "eval.batch_sizes=[$2]" "eval.num_prompts=$3" "eval.max_new_tokens=$TOKENS" \
        "eval.device=$DEVICE" "eval.out_dir=$1" "run_dir=${drafts[0]}"
}

start=$(date +%s)
bench "$OUT/batch1" 1 "$PROMPTS_B1"
bench "$OUT/batched" "$BATCHES" "$PROMPTS"
echo
cat "$OUT/batch1/results.md" "$OUT/batched/results.md"
echo "gpu_bench: ${#drafts[@]} drafts, $(( $(date +%s) - start )) s, device $DEVICE; results under $OUT"

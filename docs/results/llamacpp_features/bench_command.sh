#!/bin/bash
cd /work/main
GSM="data.name=gsm8k data.mix=[] data.path=/work/shared/data/gsm8k/train.jsonl data.split=validation data.val_fraction=0.1 trainer.val_data=split"
SPECFT_LLAMACPP=/work/llamacpp PYTHONPATH=/work/snap50b .venv/bin/python /work/snap50b/scripts/bench_llamacpp.py --targets q4_k_m=/work/ggufs/smollm2-Q4_K_M.gguf --drafts baseline_16bit=/work/study/q4km/base-bf16 specft_emulated=/work/study/q4km/ours-q4km specft_llamacpp=/work/study/q4km/ours-q4km-llamacpp --prompts-run /work/study/q4km/ours-q4km --num-prompts 128 --max-new-tokens 64 --ks 3 --slots 1 --repeats 1 --threads 2 --out /work/results/engine_features $GSM
echo "rc=$?"

#!/bin/bash
# third draft: specft's recipe, features from llama.cpp itself (cache.engine=llamacpp); resumable
source /work/main/.venv/bin/activate
export PYTHONPATH=/work/snap50b SPECFT_LLAMACPP=/work/llamacpp
cd /work/study/q4km
echo "\$ specft train ... cache.engine=llamacpp run_dir=/work/study/q4km/ours-q4km-llamacpp" >> commands.log
python -m specft.cli train model=hf model.path=/work/ggufs/smollm2-Q4_K_M.gguf quant=checkpoint data=mix "data.mix=[{name: gsm8k, path: '/work/shared/data/gsm8k/train.jsonl', num_samples: 520},{name: sharegpt, path: '/work/shared/data/sharegpt_sample/conversations.json', num_samples: 160, max_turns: 4, val_fraction: 0.3}]" data.split=train data.val_fraction=0.1 data.regenerate.enabled=true data.regenerate.max_new_tokens=128 data.regenerate.batch_size=32 data.max_seq_len=512 cache.root=/work/study/q4km/cache cache.engine=llamacpp draft.ttt_steps=3 draft.vocab_size=4096 draft.vocab_fill=prior trainer.max_steps=480 trainer.save_every=40 trainer.val_data=heldout trainer.val_samples=128 trainer.val_batches=128 "eval.k=[3,4,5]" eval.max_new_tokens=64 seed=0 run_dir=/work/study/q4km/ours-q4km-llamacpp

"""What a quantizer's own model computes on a few chat prompts, stored beside the
checkpoint it wrote (``oracle.safetensors``) so that specft's tests compare against it
without the quantizer installed. Imported by the oracle scripts that run in the
quantizers' own venvs (scripts/msmodelslim_oracle.py, scripts/make_modelopt_checkpoints.py):
it needs torch only.
"""

from __future__ import annotations

import torch

N_PROMPTS, NEW_TOKENS, LOGIT_POSITIONS = 3, 8, 4


@torch.no_grad()
def oracle_outputs(model, tokenizer) -> dict[str, torch.Tensor]:
    """Prompt ids (cut to one width), every decoder layer's output (``hidden.<i>``), the
    logits at the last positions (the rest is only size) and a greedy continuation."""
    questions = [f"What is {i * 7 + 3} plus {i * 11 + 5}? Explain step by step." for i in range(N_PROMPTS)]
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False) for q in questions]
    width = min(len(i) for i in ids)
    input_ids = torch.tensor([i[:width] for i in ids])
    res = model(input_ids, output_hidden_states=True)
    out = {"input_ids": input_ids, "logits": res.logits[:, -LOGIT_POSITIONS:].contiguous()}
    for i, h in enumerate(res.hidden_states[1:]):
        out[f"hidden.{i}"] = h.contiguous()
    out["greedy"] = model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                   pad_token_id=tokenizer.pad_token_id)
    return out

"""Mixture-of-Experts checkpoints onto transformers' fused experts.

Quantizers store each expert's projections as Linear layers of their own
(``mlp.experts.<e>.gate_proj`` / ``up_proj`` / ``down_proj``, as Qwen's FP8 and GPTQ
releases and GPTQModel do), while transformers keeps a layer's experts fused in two 3-D
parameters: ``gate_up_proj`` [E, 2I, H] (each expert's gate rows, then its up rows) and
``down_proj`` [E, H, I]. While a family reads the checkpoint, ``expert_views`` puts a
stand-in Linear (on the meta device: shapes only) at every per-expert name, so the family
dequantizes those layers like any other; ``fuse_expert_weights`` then stacks the dense
weights into the fused parameters. Weight-only experts (GPTQ, AWQ, W4A16) run as
transformers runs them; experts whose inputs the checkpoint quantizes dynamically, the
same for every expert (HF FP8 blocks, FP8 / INT8 dynamic), run through the quantized
experts loop (expert_input_quantizers); static per-expert input scales are refused.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from specft.common.errors import SpecftError
from specft.quant.model_hooks import full_shape, fused_experts

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@contextmanager
def expert_views(model: nn.Module):
    """Per-expert stand-in Linears under each fused experts module while inside."""
    added = []
    for experts in fused_experts(model).values():
        count, two_i, hidden = full_shape(experts.gate_up_proj)
        inter = two_i // 2
        for e in range(count):
            view = nn.Module()
            view.gate_proj = nn.Linear(hidden, inter, bias=False, device="meta")
            view.up_proj = nn.Linear(hidden, inter, bias=False, device="meta")
            view.down_proj = nn.Linear(inter, hidden, bias=False, device="meta")
            experts.add_module(str(e), view)
            added.append((experts, str(e)))
    try:
        yield
    finally:
        for experts, key in added:
            del experts._modules[key]


def _stack(name: str, count: int, pieces: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layer's fused parameters from its per-expert weights (taken out of ``pieces``)."""
    keys = {(e, p): f"{name}.{e}.{p}.weight" for e in range(count) for p in PROJECTIONS}
    absent = [k for k in keys.values() if k not in pieces]
    if absent:
        raise SpecftError(f"model.path: {absent[0]} is missing from the checkpoint (its layer's other experts "
                          "are there)")
    gate_up = torch.stack([torch.cat([pieces.pop(keys[e, "gate_proj"]), pieces.pop(keys[e, "up_proj"])])
                           for e in range(count)])
    down = torch.stack([pieces.pop(keys[e, "down_proj"]) for e in range(count)])
    return {f"{name}.gate_up_proj": gate_up, f"{name}.down_proj": down}


def fuse_expert_weights(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Per-expert dense weights in ``state`` stacked into the fused parameters (in place)."""
    for name, experts in fused_experts(model).items():
        count = full_shape(experts.gate_up_proj)[0]
        if any(f"{name}.{e}.{p}.weight" in state for e in range(count) for p in PROJECTIONS):
            state.update(_stack(name, count, state))  # else stored fused (or missing: the loader names it)


class ExpertPieces:
    """Per-expert dense weights held until their layer has all of them, then stacked: a
    sharded load writes each layer's fused parameters as soon as they are whole, so no
    rank holds more than one layer's experts dense."""

    def __init__(self, model: nn.Module):
        self.count = {name: full_shape(m.gate_up_proj)[0] for name, m in fused_experts(model).items()}
        self.held: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The layer's fused parameters once ``key`` completes them ({} until then); None
        when ``key`` is no expert's weight."""
        parts = key.rsplit(".", 3)
        if len(parts) != 4 or parts[0] not in self.count or parts[2] not in PROJECTIONS or parts[3] != "weight":
            return None
        layer, count = parts[0], self.count[parts[0]]
        held = self.held.setdefault(layer, {})
        held[key] = tensor
        if len(held) < count * len(PROJECTIONS):
            return {}
        return _stack(layer, count, self.held.pop(layer))

    def finish(self) -> None:
        """Refuses a layer some of whose experts never came."""
        for layer, held in self.held.items():
            _stack(layer, self.count[layer], dict(held))


def expert_input_quantizers(name: str, layers: dict) -> tuple | None:
    """(gate/up input quantizer, down input quantizer) of the fused experts ``name``, None
    for weight-only experts. Dynamic quantizers that every expert shares (the same
    ``share_key``: FP8 per token or token group, INT8 per token) run as vLLM's fused MoE
    runs them: the layer's input quantized once for every expert's gate and up, each
    expert's intermediate before its down. Experts with static per-expert scales, or
    that differ, are refused: no producing tool here writes one to check against."""
    experts = {n: q for n, q in layers.items() if n.startswith(name + ".")}
    if not experts or all(q.quantize_input is None for q in experts.values()):
        return None
    chosen = []
    for projections in (("gate_proj", "up_proj"), ("down_proj",)):
        group = [q for n, q in sorted(experts.items()) if n.rsplit(".", 1)[-1] in projections]
        keys = {getattr(q.quantize_input, "share_key", None) for q in group}
        if None in keys or len(keys) != 1:
            what = next((q for q in group if getattr(q.quantize_input, "share_key", None) is None), group[0])
            raise SpecftError(f"quant=checkpoint: {what.name} quantizes the expert's input "
                              f"({what.activation or '16-bit'}) differently from its layer's other experts or with a "
                              "static scale of its own, which specft cannot run in fused experts yet; experts with "
                              "dynamic input quantization shared by all (FP8 per token or token group, INT8 per "
                              "token) and weight-only experts run")
        chosen.append(group[0].quantize_input)
    return tuple(chosen)

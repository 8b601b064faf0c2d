"""Shared test helpers: configs from conf/ as a user would compose them."""

from pathlib import Path

import torch
from omegaconf import OmegaConf

from specft.config import ModelConfig
from specft.quant.config import QuantConfig, load_quant_config

CONF = Path(__file__).resolve().parent.parent / "conf"


def model_cfg(name: str) -> ModelConfig:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig),
                                               OmegaConf.load(CONF / "model" / f"{name}.yaml")))


def quant_cfg(name: str) -> QuantConfig:
    return load_quant_config(name)


def root_cfg(*overrides: str, run_dir="unset"):
    """A validated RootConfig composed from conf/ exactly as the CLI does."""
    from specft.cli import compose
    from specft.commands.validate import to_schema

    cfg = compose(list(overrides))
    OmegaConf.update(cfg, "run_dir", str(run_dir), force_add=True)
    return to_schema(cfg)


def run_ranks(worker: str, nproc: int, *args: str) -> None:
    """Run tests/<worker> as ``nproc`` ranks under torch.distributed.run; fail on error."""
    import subprocess
    import sys

    from specft.common.launch import free_port

    script = Path(__file__).with_name(worker)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                           "--master_port", str(free_port()), str(script), *args],
                          capture_output=True, text=True, timeout=3600, cwd=script.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]


def float64_target(name: str):
    """The tiny target in float64 with RMSNorm kept in float64 (transformers' upcasts to
    float32, which would hide the fold's exactness behind float32 rounding)."""
    import types

    import torch

    from specft.target_model import load_target

    model, _ = load_target(model_cfg(name))
    model = model.double().eval()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # grouped_mm has no float64

    def norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(norm, module)
    return model


def checkpoint_model(path, *overrides):
    """(model, tokenizer, quant report) of the quantized checkpoint at ``path`` as specft
    runs it (model=hf quant=checkpoint, float32)."""
    from specft.quant import apply_quant
    from specft.target_model import load_target

    cfg = root_cfg("model=hf", f"model.path={path}", "quant=checkpoint", "model.dtype=float32", *overrides)
    model, tokenizer = load_target(cfg.model)
    report = apply_quant(model, cfg.quant)
    return model.eval(), tokenizer, report


def on_oracle_kernels() -> bool:
    """Whether PyTorch dispatches its CPU float kernels at the level the checkpoint oracles
    were computed on (AVX512). Elsewhere (AVX2) float32 sums round otherwise in the last
    bit, and a dynamic int8 code on a rounding edge can flip and carry downstream."""
    import torch

    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def max_rel(a, b) -> float:
    """max |a - b| / max |b|, in float64."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def steered(runner_cls):
    """``runner_cls`` (a parallel or block drafter's runner) with its drafted tokens
    steered towards the target's own greedy continuation, each replaced by it with
    probability 1 - eps: a random draft is never accepted, and the runner's cache must
    follow every accepted length. Each round's own drafted tokens land in ``drafted``."""
    from specft.decoding.draft import TargetAsDraft

    class Steered(runner_cls):
        def __init__(self, draft, model, eps, seed):
            super().__init__(draft)
            self.oracle = TargetAsDraft(model)
            self.eps, self.gen = eps, torch.Generator().manual_seed(seed)
            self.drafted = []

        def reset(self, batch, device):
            super().reset(batch, device)
            self.oracle.reset(batch, device)

        def select_rows(self, rows):
            super().select_rows(rows)
            self.oracle.select_rows(rows)

        def extend(self, aux, final, tokens, next_tokens, valid):
            super().extend(aux, final, tokens, next_tokens, valid)
            return self.oracle.extend(aux, final, tokens, next_tokens, valid)

        def propose(self, hidden, logits, k, s, min_confidence=0.0, generator=None):
            mine = super().propose(None, None, k, s)
            self.drafted.append(mine.tokens)
            truth = self.oracle.propose(hidden, logits, k, s).tokens
            keep = torch.rand(truth.shape, generator=self.gen) < self.eps
            mine.tokens = torch.where(keep, mine.tokens, truth)
            return mine

    return Steered


def context_in_three_extends(hidden: int = 32, vocab: int = 64):
    """A draft's context as decoding adds it: two rows of 12 tokens with their target
    features (3 x ``hidden``, float64), 11 context columns of which row 1 rejected column
    5, each kept column paired with the next kept token (x[11] after the last). Returns
    (x, aux, keep, next tokens)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (2, 12), generator=gen)
    aux = torch.randn(2, 12, 3 * hidden, generator=gen, dtype=torch.float64)
    keep = torch.ones(2, 11, dtype=torch.bool)
    keep[1, 5] = False
    nxt = x.clone()
    for row in range(2):
        cols = [*keep[row].nonzero().flatten().tolist(), 11]
        for here, after in zip(cols, cols[1:]):
            nxt[row, here] = x[row, after]
    return x, aux, keep, nxt

"""How the target is laid out across ranks for stage 1 (`cache.sharding`), a registry:

- `none`: every rank holds the whole model and computes its own slice of the data.
- `zero3`: DeepSpeed ZeRO-3 inference. transformers builds the model under
  `deepspeed.zero.Init` and loads the checkpoint file by file into partitioned parameters
  (no rank ever holds the whole model); each forward gathers one layer at a time. Every
  rank still computes its own data (ZeRO is data parallel), so ranks must run the same
  number of forwards: `Lockstep` pads the shorter ranks with throwaway forwards.
- `tp`: transformers' tensor-parallel plan (`tp_plan="auto"`) over groups of
  `cache.tp_size` ranks; the ranks of a group compute the same data, groups split it.
- `device_map`: accelerate places the layers of one process over the host's devices
  (`device_map="auto"`), for one host with several accelerators.

Weights are quantized after loading, one parameter at a time through `weight_editor`, so
the full tensor of one parameter is the most any rank materializes.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from specft.common.errors import ConfigError
from specft.common.registry import Registry
from specft.config import RootConfig
from specft.target_model.partitioned_load import zero3_edit

log = logging.getLogger(__name__)

SHARDINGS: Registry = Registry("target sharding")


class Lockstep:
    """Keeps ranks' forward counts equal when a forward is a collective (ZeRO-3 gathers).

    Every forward, real or throwaway, is preceded by `step(active)`: an all-reduce that
    says whether any rank still has real work. A rank out of work calls `drain(fn)` to run
    throwaway forwards until every rank is done."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def step(self, active: bool) -> bool:
        if not self.enabled:
            return active
        import torch.distributed as dist

        flag = torch.tensor([int(active)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def drain(self, throwaway) -> None:
        while self.enabled and self.step(False):
            throwaway()


@dataclass
class PlacedTarget:
    """The target model and the part of the data this rank computes and writes."""
    model: nn.Module
    data_rank: int = 0  # which slice of the data (shards are named by it)
    data_world: int = 1  # how many slices
    writer: bool = True  # writes shards and regenerated answers for its slice
    lockstep: Lockstep = field(default_factory=lambda: Lockstep(False))
    weight_editor: object = None  # context manager factory: param -> full tensor to edit
    engine: object = None  # keeps a DeepSpeed engine (and its hooks) alive

    def local_weight_bytes(self) -> int:
        """Bytes of model parameters this rank holds (its partition under ZeRO-3 or TP)."""
        total = 0
        for p in self.model.parameters():
            local = getattr(p, "ds_tensor", None)
            if local is None:
                local = p.to_local() if hasattr(p, "to_local") else p
            total += local.numel() * local.element_size()
        return total


def _from_pretrained(cfg: RootConfig, **kwargs):
    from specft.target_model.loader import load_target

    return load_target(cfg.model, **kwargs)


@SHARDINGS.register("none")
def _replicated(cfg: RootConfig, rank: int, world: int) -> PlacedTarget:
    model, _ = _from_pretrained(cfg)
    return PlacedTarget(model, rank, world)


@SHARDINGS.register("device_map")
def _device_map(cfg: RootConfig, rank: int, world: int) -> PlacedTarget:
    if world > 1:
        raise ConfigError("cache.sharding=device_map places one process over its host's devices; "
                          "use trainer.nproc=1 (or zero3 / tp for several ranks)")
    model, _ = _from_pretrained(cfg, device_map="auto")
    log.info("target placed by accelerate: %s", sorted({str(p.device) for p in model.parameters()}))
    return PlacedTarget(model)


def zero3_config(dtype: str = "float32") -> dict:
    """The DeepSpeed config of a ZeRO-3 target in ``dtype`` (a model.dtype name)."""
    # Persistence threshold 0: every parameter is partitioned, however small (the default
    # keeps small ones whole on every rank, which hides the memory split in tests).
    # zero.Init casts every parameter to the config's precision, float32 unless bf16 or
    # fp16 is enabled: a bfloat16 target would otherwise run (and be held) in float32.
    return {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "bf16": {"enabled": dtype == "bfloat16"}, "fp16": {"enabled": dtype == "float16"},
            "train_micro_batch_size_per_gpu": 1}


@SHARDINGS.register("zero3")
def _zero3(cfg: RootConfig, rank: int, world: int) -> PlacedTarget:
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    from specft.device import resolve_dtype

    ds_config = zero3_config(resolve_dtype(cfg.model.dtype))
    # transformers reads ZeRO-3 from this object while it is alive: the model is built
    # under zero.Init and each checkpoint file is loaded into the partitions.
    marker = HfDeepSpeedConfig(ds_config)
    model, _ = _from_pretrained(cfg)
    engine = deepspeed.initialize(model=model, config=ds_config)[0]
    engine.module.eval()
    return PlacedTarget(engine.module, rank, world, lockstep=Lockstep(world > 1), weight_editor=zero3_edit,
                        engine=(engine, marker))


@contextmanager
def _dtensor_edit(param: nn.Parameter):
    """The full tensor of a tensor-parallel parameter; edits are scattered back."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    data = param.data
    if not isinstance(data, DTensor):
        yield data
        return
    full = data.full_tensor()
    yield full
    data.to_local().copy_(distribute_tensor(full, data.device_mesh, data.placements).to_local())


@SHARDINGS.register("tp")
def _tensor_parallel(cfg: RootConfig, rank: int, world: int) -> PlacedTarget:
    from torch.distributed.device_mesh import init_device_mesh

    from specft.device import select_device

    tp = cfg.cache.tp_size or world
    if world % tp:
        raise ConfigError(f"cache.tp_size={tp} must divide the number of ranks ({world})")
    mesh = init_device_mesh(select_device().kind, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    model, _ = _from_pretrained(cfg, tp_plan="auto", device_mesh=mesh["tp"])
    return PlacedTarget(model, rank // tp, world // tp, writer=rank % tp == 0, weight_editor=_dtensor_edit)


def place_target(cfg: RootConfig, rank: int, world: int) -> PlacedTarget:
    placed = SHARDINGS.get(cfg.cache.sharding, "cache.sharding")(cfg, rank, world)
    log.info("target: cache.sharding=%s, rank %d holds %.1f MB of weights, computes data slice %d of %d",
             cfg.cache.sharding, rank, placed.local_weight_bytes() / 1e6, placed.data_rank, placed.data_world)
    return placed


def editing(placed: PlacedTarget | None):
    """The weight editor to hand to apply_quant (plain tensors when unsharded)."""
    from specft.quant.apply import plain_weights

    return placed.weight_editor if placed is not None and placed.weight_editor else plain_weights


__all__ = ["SHARDINGS", "Lockstep", "PlacedTarget", "editing", "place_target", "zero3_config"]

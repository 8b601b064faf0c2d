"""Device and distributed-backend selection: Ascend NPU (torch_npu, imported only when
installed), CUDA, or CPU. torch_npu is never imported at module load."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceChoice:
    kind: str  # "npu" | "cuda" | "cpu"
    dist_backend: str  # "hccl" | "nccl" | "gloo"


BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}


def npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu and DeepSpeed's npu accelerator)

    return bool(getattr(torch, "npu", None) and torch.npu.is_available())


def select_device(prefer: str | None = None, *, npu_ok=npu_available,
                  cuda_ok=torch.cuda.is_available) -> DeviceChoice:
    """``prefer`` forces a kind; otherwise NPU, then CUDA, then CPU, whichever is present."""
    checks = {"npu": npu_ok, "cuda": cuda_ok, "cpu": lambda: True}
    if prefer is not None:
        if prefer not in checks:
            raise ValueError(f"unknown device {prefer!r}; known: {', '.join(checks)}")
        if not checks[prefer]():
            raise RuntimeError(f"device {prefer!r} requested but not available")
        return DeviceChoice(prefer, BACKENDS[prefer])
    for kind in ("npu", "cuda", "cpu"):
        if checks[kind]():
            return DeviceChoice(kind, BACKENDS[kind])
    raise AssertionError("unreachable")


def init_distributed(store=None) -> None:
    """Start DeepSpeed's process group on the selected device's backend, on ``store``
    when the ranks met there already (rendezvous.py), else by torch's env:// rendezvous.

    On CPU, DeepSpeed JIT-builds a shared-memory all-reduce op at start. We turn it off:
    the build waits forever on a lock file that any build killed midway leaves behind in
    ~/.cache/torch_extensions (one killed launch hangs every later run on the machine),
    each start leaks two 69 MB buffers per rank in /dev/shm, and gloo is all a CPU run
    (tests, smoke runs) needs.
    """
    import deepspeed

    choice = select_device()
    if choice.kind == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if store is not None:  # DeepSpeed adopts a process group started before it
        import torch.distributed as dist
        from deepspeed.constants import default_pg_timeout

        dist.init_process_group(choice.dist_backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=default_pg_timeout)
    deepspeed.init_distributed(dist_backend=choice.dist_backend, verbose=False)


def native_bf16(kind: str | None = None) -> bool:
    """Whether the selected device computes bfloat16 natively. On CPU that needs
    AVX512-BF16 or AMX: without them PyTorch emulates bf16 matmuls at ~1 GFLOP/s, far
    slower than float32, so machines of one kind must not decide for another."""
    kind = kind or select_device().kind
    if kind == "npu":
        return True
    if kind == "cuda":
        return torch.cuda.is_bf16_supported()
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def resolve_dtype(name: str) -> str:
    """``auto``: bfloat16 where the device computes it natively (what serving engines run
    a quantized target in), float32 elsewhere. Any other name passes through."""
    if name != "auto":
        return name
    return "bfloat16" if native_bf16() else "float32"


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a wall-clock reading counts it (a no-op on
    CPU, whose work is done when the call returns)."""
    if device.type != "cpu":
        getattr(torch, device.type).synchronize()

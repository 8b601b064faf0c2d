"""Device selection without torch_npu or CUDA present: the logic, with fakes."""

import os

import pytest

from specft.device import select_device


def test_prefers_npu_then_cuda_then_cpu():
    assert select_device(npu_ok=lambda: True, cuda_ok=lambda: True).kind == "npu"
    assert select_device(npu_ok=lambda: True, cuda_ok=lambda: True).dist_backend == "hccl"
    assert select_device(npu_ok=lambda: False, cuda_ok=lambda: True).dist_backend == "nccl"
    assert select_device(npu_ok=lambda: False, cuda_ok=lambda: False).dist_backend == "gloo"


def test_forced_device_must_exist():
    assert select_device("cpu", npu_ok=lambda: True).kind == "cpu"
    with pytest.raises(RuntimeError, match="not available"):
        select_device("npu", npu_ok=lambda: False)
    with pytest.raises(ValueError, match="known: npu, cuda, cpu"):
        select_device("tpu")


def test_this_machine_is_cpu_and_torch_npu_is_not_imported():
    import sys

    assert select_device().kind == "cpu"
    assert "torch_npu" not in sys.modules


def test_cpu_process_group_starts_past_a_stale_extension_lock(tmp_path):
    """A build killed midway leaves DeepSpeed's shm-op lock behind; a CPU start must not
    wait on it (it would forever) nor leave buffers in /dev/shm."""
    import subprocess
    import sys

    lock = tmp_path / "ext" / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    port = 29000 + os.getpid() % 1000
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    script = ("import torch.distributed as dist\n"
              "from specft.device import init_distributed\n"
              "init_distributed()\n"
              "print('world', dist.get_world_size())\n"
              "dist.destroy_process_group()\n")
    before = set(os.listdir("/dev/shm"))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "world 1" in done.stdout
    assert lock.exists()  # still there: nobody waited on it, nobody built the op
    leaked = {n for n in set(os.listdir("/dev/shm")) - before if f"_{port}_" in n}
    assert not leaked


@pytest.mark.parametrize("avx512_bf16,amx,expected", [(True, False, "bfloat16"), (False, True, "bfloat16"),
                                                      (False, False, "float32")])
def test_auto_dtype_follows_the_cpus_bf16_support(monkeypatch, avx512_bf16, amx, expected):
    import torch

    from specft.device import native_bf16, resolve_dtype

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert native_bf16("cpu") == (expected == "bfloat16")
    assert resolve_dtype("auto") == expected
    assert resolve_dtype("float64") == "float64"  # explicit choices pass through


def test_config_resolves_auto_before_anything_is_keyed(monkeypatch):
    """The run's config (and so the cache key) holds the dtype that ran, and eval follows
    the target unless told otherwise."""
    import torch

    from specft.provenance.keys import cache_key

    from helpers import root_cfg

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    plain = root_cfg("model=smollm2_135m")
    assert (plain.model.dtype, plain.eval.dtype) == ("float32", "float32")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    native = root_cfg("model=smollm2_135m")
    assert (native.model.dtype, native.eval.dtype) == ("bfloat16", "bfloat16")
    assert root_cfg("model=smollm2_135m", "eval.dtype=float64").eval.dtype == "float64"
    assert cache_key(plain.model) != cache_key(native.model)


@pytest.mark.parametrize("native,precision,warns", [(False, "amp_bf16", True), (False, "bf16", True),
                                                    (False, "fp32", False), (True, "amp_bf16", False)])
def test_bf16_training_without_native_bf16_is_warned(monkeypatch, caplog, native, precision, warns):
    import torch

    from specft.commands.preflight import warn_emulated_bf16

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    with caplog.at_level("WARNING", logger="specft.commands.preflight"):
        assert warn_emulated_bf16(precision) == warns
    assert ("no native bfloat16" in caplog.text) == warns

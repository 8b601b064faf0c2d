"""Device selection without torch_npu or CUDA present: the logic, with fakes."""

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

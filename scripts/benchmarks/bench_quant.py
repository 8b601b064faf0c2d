"""Fake-quantization throughput per format, and the cost activation quantization adds to
one forward of smollm2_135m. Prints a table and writes JSON.

    python scripts/benchmarks/bench_quant.py --out docs/results/bench_quant.json

Throughput is input bytes / second, beside a plain copy (clone) of the same tensor on the
same machine in the same run: compare the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from specft.quant import TensorQuantSpec, apply_quant, calibrate, fake_quant  # noqa: E402

SPECS = {
    "copy (reference)": None,
    "fp8 e4m3 per-token": TensorQuantSpec("e4m3", "token"),
    "fp8 e5m2 per-token": TensorQuantSpec("e5m2", "token"),
    "fp8 e4m3 1x128 group": TensorQuantSpec("e4m3", "group", 128),
    "fp8 e4m3 128x128 block": TensorQuantSpec("e4m3", "block", 128),
    "mxfp8 e4m3 (mx32)": TensorQuantSpec("e4m3", "mx", 32),
    "mxfp4 e2m1 (mx32)": TensorQuantSpec("e2m1", "mx", 32),
    "nvfp4 (e2m1, 16)": TensorQuantSpec("e2m1", "nvfp4", 16),
    "int8 per-channel": TensorQuantSpec("int8", "channel"),
    "int4 g128 asym": TensorQuantSpec("int4", "group", 128, symmetric=False),
    "hif8 per-tensor": TensorQuantSpec("hif8", "tensor"),
}


def _time(fn, reps: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_throughput(rows: int, cols: int, reps: int) -> list[dict]:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    nbytes = x.numel() * x.element_size()
    out = []
    for name, spec in SPECS.items():
        fn = (lambda: x.clone()) if spec is None else (lambda s=spec: fake_quant(x, s))
        t = _time(fn, reps)
        out.append({"format": name, "seconds": t, "GB_per_s": nbytes / t / 1e9})
    copy_rate = out[0]["GB_per_s"]
    for r in out:
        r["vs_copy"] = r["GB_per_s"] / copy_rate
    return out


def bench_forward(quant_names: list[str], batch: int, seq: int, reps: int) -> list[dict]:
    from specft.target_model import load_target

    from helpers import model_cfg, quant_cfg  # conf/ as the CLI composes it

    base, _ = load_target(model_cfg("smollm2_135m"))
    ids = torch.randint(0, 49152, (batch, seq), generator=torch.Generator().manual_seed(0))
    out = []
    for name in quant_names:
        model, _ = load_target(model_cfg("smollm2_135m"))
        q = quant_cfg(name)
        report = apply_quant(model, q)
        if q.needs_calibration:
            calibrate(model, report, [{"input_ids": ids[:1]}])
        with torch.no_grad():
            t = _time(lambda m=model: m(ids), reps)
        out.append({"quant": name, "seconds": t, "weight": bool(q.weight), "activation": bool(q.activation)})
    del base
    plain = out[0]["seconds"]
    for r in out:
        r["overhead_vs_bf16"] = r["seconds"] / plain - 1
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--quants", default="bf16,fp8,mxfp4,mxfp8,nvfp4,w4a16,w8a8_int8,hif8,fp8_block")
    p.add_argument("--skip-forward", action="store_true")
    p.add_argument("--out", type=Path, default=Path("docs/results/bench_quant.json"))
    args = p.parse_args()

    torch.set_grad_enabled(False)
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                          "torch": torch.__version__},
              "tensor": [args.rows, args.cols], "throughput": bench_throughput(args.rows, args.cols, args.reps)}
    print(f"\nfake quantization of a {args.rows}x{args.cols} fp32 tensor ({torch.get_num_threads()} threads)")
    print(f"{'format':28s} {'GB/s':>8s} {'x copy':>8s}")
    for r in result["throughput"]:
        print(f"{r['format']:28s} {r['GB_per_s']:8.2f} {r['vs_copy']:8.3f}")
    if not args.skip_forward:
        result["forward"] = bench_forward(args.quants.split(","), args.batch, args.seq, args.reps)
        result["forward_shape"] = [args.batch, args.seq]
        print(f"\nsmollm2_135m forward, batch {args.batch} x {args.seq} tokens (fp32 compute)")
        print(f"{'quant':12s} {'seconds':>9s} {'overhead':>9s}")
        for r in result["forward"]:
            print(f"{r['quant']:12s} {r['seconds']:9.3f} {100 * r['overhead_vs_bf16']:8.1f}%")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

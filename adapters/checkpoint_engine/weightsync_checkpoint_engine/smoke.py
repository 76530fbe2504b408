"""A quick check on a GPU host, before the suites: deploy, push N versions of a small model through
checkpoint-engine, read the engine back, print each push's wall time (and where it went).

    python -m weightsync_checkpoint_engine.smoke [--pushes 10] [--device cuda:0] [--mib 64]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from harness.api import spec_of
from harness.checks import bitwise_mismatches
from harness.deployment import push
from weightsync_checkpoint_engine.backend import make_backend


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m weightsync_checkpoint_engine.smoke")
    p.add_argument("--pushes", type=int, default=10)
    p.add_argument("--device", default="cuda:0")
    p.add_argument(
        "--mib", type=int, default=64, help="payload (bf16 tensors of 4 MiB) beside a few odd ones"
    )
    a = p.parse_args(argv)
    backend = make_backend(device=a.device)
    gen = torch.Generator().manual_seed(0)
    weights = {f"w.{i}": torch.randn(1024, 2048, generator=gen).to(torch.bfloat16) for i in range(a.mib // 4)}
    weights |= {"odd.f32": torch.randn(7, 13, generator=gen), "scale.f32": torch.tensor(0.25)}
    times, laps = [], []
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        dep = backend.deploy(1, spec_of(weights), d)
        print(f"deploy: {time.perf_counter() - t0:.2f} s", flush=True)
        try:
            for v in range(1, a.pushes + 1):
                version = {n: t + v if t.is_floating_point() else t for n, t in weights.items()}
                lap: dict[str, float] = {}
                t0 = time.perf_counter()
                push(dep, v, version, timings=lap)
                times.append(time.perf_counter() - t0)
                laps.append(lap)
                print(
                    f"push {v}: {times[-1] * 1e3:.1f} ms ("
                    + ", ".join(f"{k} {s * 1e3:.1f}" for k, s in lap.items())
                    + ")",
                    flush=True,
                )
            bad = bitwise_mismatches(version, dep.handles[0].engine.read_weights())
            print(
                f"engine serves version {dep.handles[0].engine.weight_version}; mismatches: {bad[:3] or 'none'}"
            )
        finally:
            dep.close()
    later = times[1:] or times
    print(
        f"{a.mib} MiB + 2 small tensors: median push {statistics.median(later) * 1e3:.1f} ms over pushes 2..{len(times)}"
        f" (first {times[0] * 1e3:.1f} ms)"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

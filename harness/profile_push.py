"""Where one sync's fixed cost goes: the bare lifecycle of a path profiled in the trainer and its ranks.

    python -m harness.profile_push --backend ipc --device cuda --pushes 200 --out DIR

The payload is the bench's bare row (8 tensors of one bf16 element: nothing but the lifecycle), or with
`--tensor-bytes N` 8 tensors of N bytes each: on a GPU, whole 16-byte words take the same-GPU path's
in-place read (the bench's sized rows do), where the bare row's odd sizes are packed. Five ways of
pushing the same version, each the median of `--pushes`:

- `after-gc`: a gc sweep before each push, as SyncBench's rows are timed (caches refilled as after a
  trainer's step);
- `warm`: back to back, nothing between pushes;
- `after-gc-frozen`: a gc sweep before each push with every object of this process frozen first
  (`gc.freeze()`): the sweep walks nothing, so the gap to `after-gc` is what walking the heap costs;
- `phases`: after a gc sweep with the phase marks recording (SyncBench's own setting: on a GPU each
  phase ends with a device synchronize), with the median of each step and phase;
- `profiled`: after a gc sweep under cProfile, the trainer here and every rank process
  (WEIGHTSYNC_PROFILE_DIR: a rank profiles itself until it exits).

Writes `summary.json`, `trainer.txt` and `rank<r>.txt` (the functions by own time and by cumulative
time) and the raw `.pstats` under DIR, and prints the medians.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import tempfile
import time
from pathlib import Path

from harness import phases
from harness.api import spec_of
from harness.bench import BARE_PAYLOAD_BYTES, payload
from harness.deployment import push
from harness.devices import normalize, set_run_device
from harness.registry import resolve_backend

PROFILE_ENV = "WEIGHTSYNC_PROFILE_DIR"
PROFILE_SKIP_ENV = "WEIGHTSYNC_PROFILE_SKIP"  # updates a rank lets pass before it profiles
WARMUP = 20


def _timed(deployment, weights, pushes: int, version, sweep: bool, laps_out=None) -> list[float]:
    times = []
    for _ in range(pushes):
        if sweep:
            gc.collect()
        laps: dict[str, float] = {}
        gc.disable()
        t0 = time.perf_counter()
        try:
            push(deployment, next(version), weights, timings=laps)
        finally:
            gc.enable()
        times.append(time.perf_counter() - t0)
        if laps_out is not None:
            laps_out.append(laps)
    return times


def _ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 4)


def _stats_text(paths: list[Path], top: int) -> str:
    stats = pstats.Stats(*map(str, paths))
    out = io.StringIO()
    stats.stream = out
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def profile(
    backend_name: str,
    device: str,
    receivers: int,
    pushes: int,
    out: Path,
    top: int = 40,
    tensor_bytes: int | None = None,
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    device = set_run_device(normalize(device))
    backend = resolve_backend(backend_name, device)
    weights = payload(BARE_PAYLOAD_BYTES if tensor_bytes is None else 8 * tensor_bytes, device=device)
    version = iter(range(1, 1 << 30))
    summary: dict = {"backend": backend_name, "device": device, "receivers": receivers, "pushes": pushes}
    summary["tensor_bytes"] = sorted({t.numel() * t.element_size() for t in weights.values()})
    with tempfile.TemporaryDirectory(prefix="profile-push-") as work:
        deployment = backend.deploy(receivers, spec_of(weights), work)
        try:
            _timed(deployment, weights, WARMUP, version, sweep=False)  # warm-up
            summary["after_gc_ms"] = _ms(_timed(deployment, weights, pushes, version, sweep=True))
            summary["warm_ms"] = _ms(_timed(deployment, weights, pushes, version, sweep=False))
            # the same sweep with this process's objects frozen (gc.freeze(), as vLLM does once started): the
            # collection then walks none of them, so what the sweep costs the push is its walk of the heap
            gc.freeze()
            try:
                summary["after_gc_frozen_ms"] = _ms(_timed(deployment, weights, pushes, version, sweep=True))
            finally:
                gc.unfreeze()
        finally:
            deployment.close()
        # phases on: SyncBench's setting (ranks read it when they start, so a deployment of its own)
        was = phases.enabled()
        phases.set_enabled(True)
        deployment = backend.deploy(receivers, spec_of(weights), work)
        take_ranks = getattr(deployment, "take_phases", lambda: [])
        try:
            _timed(deployment, weights, WARMUP, version, sweep=False)
            laps: list[dict] = []
            sender: list[dict] = []
            ranks: list[dict] = []
            times = []
            for _ in range(pushes):
                phases.take()
                take_ranks()
                times += _timed(deployment, weights, 1, version, sweep=True, laps_out=laps)
                sender.append(phases.take().get("sender", {}))
                ranks.append(max(take_ranks() or [{}], key=lambda r: sum(r.get("receiver", {}).values())))
            summary["phases_ms"] = _ms(times)
            summary["steps_ms"] = {k: _ms([lap.get(k, 0.0) for lap in laps]) for k in laps[0]}
            summary["sender_phases_ms"] = {
                k: _ms([s.get(k, 0.0) for s in sender]) for k in sorted({k for s in sender for k in s})
            }
            summary["receiver_phases_ms"] = {
                k: _ms([r.get("receiver", {}).get(k, 0.0) for r in ranks])
                for k in sorted({k for r in ranks for k in r.get("receiver", {})})
            }
        finally:
            deployment.close()
            phases.set_enabled(was)
        # cProfile in the trainer and in every rank (ranks dump their profile as they exit)
        rank_dir = out / "ranks"
        rank_dir.mkdir(exist_ok=True)
        os.environ[PROFILE_ENV] = str(rank_dir)
        os.environ[PROFILE_SKIP_ENV] = str(WARMUP)  # the ranks profile the timed pushes only
        try:
            deployment = backend.deploy(receivers, spec_of(weights), work)
        finally:
            os.environ.pop(PROFILE_ENV, None)
            os.environ.pop(PROFILE_SKIP_ENV, None)
        try:
            _timed(deployment, weights, WARMUP, version, sweep=False)
            profiler = cProfile.Profile()
            times = []
            for _ in range(pushes):
                gc.collect()
                profiler.enable()
                times += _timed(deployment, weights, 1, version, sweep=False)
                profiler.disable()
            summary["profiled_ms"] = _ms(times)
        finally:
            deployment.close()
    profiler.dump_stats(str(out / "trainer.pstats"))
    (out / "trainer.txt").write_text(_stats_text([out / "trainer.pstats"], top))
    for path in sorted(rank_dir.glob("rank*.pstats")):
        (out / f"{path.stem.split('-')[0]}.txt").write_text(_stats_text([path], top))
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harness.profile_push", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--backend", default="ipc")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--receivers", type=int, default=1)
    parser.add_argument("--pushes", type=int, default=200)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--tensor-bytes", type=int, default=None, help="8 tensors of this many bytes each")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    summary = profile(
        args.backend, args.device, args.receivers, args.pushes, args.out, args.top, args.tensor_bytes
    )
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Kernel-level timings of the device digest on a GPU, for whoever works on its Triton kernels: not a
product feature and not the GPU run. Two variants, one JSON file (`gpu_results.json`) under --out:

- `digests`: the ws64x2 kernels against the torch-ops reference (same bits), their throughput beside a
  device-to-device copy and a clone timed in the same run, the receiver's fused copy-and-verify, and
  manifests built and verified with them against xxh3;
- `digest_sweep`: the bucket kernel's schedule sweep (SWEEP_CONFIGS: BLOCK x num_warps x CHUNK x STREAM),
  each checked against the reference and timed beside a plain clone; it picks `CHUNK_CONFIG` in
  harness/device_digest.py.

    python -m harness.gpu_check --out $OUT                      # both variants, one GPU
    python -m harness.gpu_check --out $OUT --only digest_sweep

The product's GPU run is `.ci/gpu-run.sh`: the GPU tests, then `weightsync bench --device cuda` (the
paths against the device copy and NCCL ceilings) and `weightsync certify --device cuda` (conformance,
faults, gated throughput). Method: CUDA events around kernels (host clock with synchronisation where
launches and transfers are part of the cost), warm-up first, median of repeats; every timed result
checked bit for bit; payloads random, never zeros.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from harness.manifest import Manifest

REPEATS = 10


def _timed(fn, repeats=REPEATS, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _model_like(nbytes: int, device: str, seed: int, n: int) -> dict[str, torch.Tensor]:
    """`n` bf16 tensors of random values summing to `nbytes`: a model's worth of weights."""
    gen = torch.Generator(device=device).manual_seed(seed)
    per = nbytes // 2 // n
    return {f"w{i}": torch.randn(per, generator=gen, device=device).to(torch.bfloat16) for i in range(n)}


def _event_time(fn, repeats=REPEATS, warmup=3) -> float:
    """Median GPU time of `fn` between CUDA events (no host synchronisation inside the region)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _received_bucket(size: int, device: str) -> tuple[Manifest, torch.Tensor]:
    """A bucket as a receiver gets it: ~16 MiB bf16 tensors of random values packed into one buffer."""
    model = _model_like(size, device, seed=9, n=max(4, size >> 24))
    manifest = Manifest.build(1, model, bucket_bytes=size + (1 << 20))
    return manifest, manifest.pack_bucket(0, model, device=device)


def digests_on_device() -> dict:
    """ws64x2 on the GPU: the kernel against the torch-ops reference (same bits, on GPU and CPU), its
    throughput against the device copy ceiling, and a manifest built and verified with it against xxh3."""
    from harness import device_digest as dd
    from harness.manifest import as_bytes, digests

    out: dict = {
        "kernel": dd.kernel_status(),
        "copy_kernel": dd.copy_kernel_available() and dd._status.get("copy"),
    }
    gen = torch.Generator().manual_seed(11)
    mismatches = []
    for n in (1, 2, 3, 4, 5, 1023, 4097, (1 << 20) + 3, (64 << 20) + 1):
        raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        on_gpu, on_cpu = dd.device_digests([raw.cuda()])[0], dd.reference_digest(raw)
        ref_gpu = dd.reference_digest(raw.cuda())  # the reference's torch ops on the GPU
        if not on_gpu == on_cpu == ref_gpu:
            mismatches.append(
                {"bytes": n, "kernel": on_gpu, "reference_cpu": on_cpu, "reference_gpu": ref_gpu}
            )
    out["kernel_vs_reference_mismatches"] = mismatches
    rows = []
    for size in (256 << 20, 1 << 30, 4 << 30):
        one = torch.randint(-(1 << 31), 1 << 31, (size // 4,), dtype=torch.int32, device="cuda")
        copy_dst = torch.empty_like(one)
        t_copy = _event_time(lambda: copy_dst.copy_(one))
        acc = torch.zeros(2, dtype=torch.int64, device="cuda")
        t_one = _event_time(lambda: dd.launch(one, acc))
        variants = {}
        if dd.kernel_status().startswith("triton"):
            for wide in (False, True):  # both kernel variants, whichever was chosen
                variants["64-bit" if wide else "32-bit"] = (
                    size / _event_time(lambda: dd.launch(one, acc, wide=wide)) / 1e9
                )
        del copy_dst
        model = _model_like(size, "cuda", seed=size % 991, n=max(8, size >> 24))  # ~16 MiB tensors
        t_model = _timed(lambda: digests(list(model.values())))  # host wall time: launches + one transfer
        words = [dd._words(as_bytes(t)) for t in model.values()]
        per = torch.zeros((len(words), 2), dtype=torch.int64, device="cuda")

        def per_tensor():  # one launch per tensor: what the many-tensor kernel saves
            for k, w in enumerate(words):
                dd.launch(w, per[k])
            per.cpu()

        t_per_tensor = _timed(per_tensor)
        rows.append(
            {
                "size": size,
                "copy_gbs_read_plus_write": 2 * size / t_copy / 1e9,
                "digest_one_tensor_ms": t_one * 1e3,
                "digest_one_tensor_gbs": size / t_one / 1e9,
                "digest_ratio_to_copy_read_bw": (size / t_one) / (2 * size / t_copy),
                "variants_gbs": variants,
                "tensors": len(model),
                "digest_model_ms": t_model * 1e3,
                "digest_model_per_tensor_launches_ms": t_per_tensor * 1e3,
                "digest_model_gbs": size / t_model / 1e9,
            }
        )
        del one, model, words
    out["throughput"] = rows
    out["bucket_kernel"] = dd._bucket_kernel() is not None and dd._status.get("bucket")
    fused = []
    for size in (64 << 20, 256 << 20, 1 << 30):  # a received bucket of 16 MiB tensors: copy out, verify
        manifest, bucket = _received_bucket(size, "cuda")
        ranges = [(e.offset, e.nbytes) for e in manifest.entries]
        t_clone = _event_time(lambda: bucket.clone())
        t_clone_then_verify = _timed(lambda: manifest.verify_all(manifest.unpack_bucket(0, bucket)))
        t_fused = _timed(lambda: dd.copy_and_digest_bucket(bucket, ranges))
        words = bucket.view(torch.int32)
        dst = torch.empty_like(words)
        acc = torch.zeros((len(ranges), 2), dtype=torch.int64, device="cuda")
        t_kernel = (
            _event_time(lambda: dd._run_bucket(words, dst, [(o // 4, n // 4) for o, n in ranges], acc))
            if out["bucket_kernel"]
            else None
        )
        fused.append(
            {
                "size": size,
                "tensors": len(manifest.entries),
                "clone_ms": t_clone * 1e3,
                "clone_then_verify_ms": t_clone_then_verify * 1e3,
                "copy_and_digest_ms": t_fused * 1e3,
                "bucket_kernel_ms": t_kernel * 1e3 if t_kernel else None,
                "kernel_over_clone": t_kernel / t_clone if t_kernel else None,
            }
        )
        del bucket, dst, words
    out["receiver_copy"] = fused
    manifests = []
    for size, algos in ((256 << 20, ("auto", "xxh3")), (1 << 30, ("auto", "xxh3")), (4 << 30, ("auto",))):
        model = _model_like(size, "cuda", seed=7, n=max(8, size >> 24))
        for algo in algos:
            t_build = _timed(
                lambda: Manifest.build(1, model, 64 << 20, digest_algorithm=algo), repeats=3, warmup=1
            )
            manifest = Manifest.build(1, model, 64 << 20, digest_algorithm=algo)
            t_verify = _timed(lambda: manifest.verify_all(model), repeats=3, warmup=1)
            flipped = dict(model)
            victim = next(iter(model))
            flipped[victim] = model[victim].clone()
            as_bytes(flipped[victim])[12345] ^= 4
            caught = manifest.wrong(flipped) == [victim]
            manifests.append(
                {
                    "size": size,
                    "algorithm": algo,
                    "tensors": len(model),
                    "build_ms": t_build * 1e3,
                    "verify_ms": t_verify * 1e3,
                    "flipped_bit_caught": caught,
                }
            )
        del model
    out["manifest"] = manifests
    return out


SWEEP_CONFIGS = [  # run 7 (2026-12-02) swept BLOCK 1024-4096 x warps 4/8 x CHUNK 2^15/2^17: small won
    {"BLOCK": block, "CHUNK": chunk, "num_warps": warps, "STREAM": stream}
    for block, warps in ((512, 4), (1024, 4), (1024, 8))
    for chunk in (1 << 12, 1 << 13, 1 << 14, 1 << 15)
    for stream in (False, True)
]


def digest_sweep(
    sizes=(64 << 20, 256 << 20, 1 << 30), configs=None, device: str = "cuda", one_words: int = 1 << 30
) -> dict:
    """The bucket kernel's schedule against a plain copy: every (BLOCK, num_warps, CHUNK) of SWEEP_CONFIGS
    checked against the reference, then timed copying and digesting a received bucket of 16 MiB tensors;
    the two fastest also copy-only and digest-only (is the mix or the schedule the limit?), and the kernel
    before the (segment, chunk) grid beside them. Device events, median of REPEATS."""
    from harness import device_digest as dd

    kernel = dd._build_chunk_kernel()
    strided = dd._build_strided_bucket_kernel()
    configs = configs or SWEEP_CONFIGS
    checks = {}
    for c in configs:
        try:
            checks[json.dumps(c)] = dd._bucket_self_test(kernel, c, device=device)
        except Exception as exc:  # noqa: BLE001 - a schedule that cannot run is left out, and says why
            checks[json.dumps(c)] = f"{type(exc).__name__}: {exc}"
    good = [c for c in configs if checks[json.dumps(c)] is None]
    rows, inputs = [], []
    for size in sizes:
        manifest, bucket = _received_bucket(size, device)
        words = bucket.view(torch.int32)
        segments = [(e.offset // 4, e.nbytes // 4) for e in manifest.entries]
        inputs.append((words, segments))  # kept for the second pass over the two fastest
        dst = torch.empty_like(words)
        acc = torch.zeros((len(segments), 2), dtype=torch.int64, device=device)
        t_clone = _event_time(lambda: bucket.clone())
        row = {
            "size": size,
            "tensors": len(segments),
            "clone_ms": t_clone * 1e3,
            "strided_kernel_ms": _event_time(
                lambda: dd._run_strided_bucket(words, dst, segments, acc, strided)
            )
            * 1e3,
            "copy_and_digest_ms": {},
        }
        want = [dd.reference_sums(words[s : s + n]) for s, n in segments]
        row["wrong"] = {}
        for c in good:
            row["copy_and_digest_ms"][json.dumps(c)] = (
                _event_time(lambda c=c: dd._run_bucket(words, dst, segments, acc, kernel, c)) * 1e3
            )
            acc.zero_(), dst.fill_(-1)  # then once more, checked: every sum and every copied word
            dd._run_bucket(words, dst, segments, acc, kernel, c)
            sums = [tuple(v & dd._M64 for v in r) for r in acc.cpu().tolist()]
            row["wrong"][json.dumps(c)] = sum(
                got != w or not torch.equal(words[s : s + n], dst[s : s + n])
                for got, w, (s, n) in zip(sums, want, segments, strict=True)
            )
        rows.append(row)
        del dst
    largest = rows[-1]["copy_and_digest_ms"]
    best = sorted(largest, key=largest.get)[:2]
    for row, (words, segments) in zip(rows, inputs, strict=True):
        dst = torch.empty_like(words)
        acc = torch.zeros((len(segments), 2), dtype=torch.int64, device=device)
        row["copy_only_ms"], row["digest_only_ms"] = {}, {}
        for key in best:
            c = json.loads(key)
            row["copy_only_ms"][key] = (
                _event_time(
                    lambda c=c: dd._run_bucket(words, dst, segments, acc, kernel, c, hash_words=False)
                )
                * 1e3
            )
            row["digest_only_ms"][key] = (
                _event_time(lambda c=c: dd._run_bucket(words, None, segments, acc, kernel, c)) * 1e3
            )
        fastest = row["copy_and_digest_ms"][best[0]]
        row["best"] = best[0]
        row["best_over_clone"] = fastest / row["clone_ms"]
        row["strided_over_clone"] = row["strided_kernel_ms"] / row["clone_ms"]
        del dst
    del inputs
    result = {"self_tests": checks, "best": best[0], "rows": rows}
    try:  # what follows must not lose the rows above (run 8 lost them to one oversized grid)
        result["one_tensor_digest"] = _one_tensor_digests(dd, kernel, best, device, one_words)
        result["manifest_digests"] = _manifest_digests(dd, kernel, best[0], device, sizes[-1])
    except Exception as exc:  # noqa: BLE001 - reported in the results
        result["error"] = f"{type(exc).__name__}: {exc}"
    return result


def _one_tensor_digests(dd, kernel, keys: list[str], device: str, words: int) -> dict:
    """One large tensor (4 GiB on the GPU), digest only: the grid-stride kernel against the chunk grid
    (the schedules whose grid covers it)."""
    one = torch.randint(-(1 << 31), 1 << 31, (words,), dtype=torch.int32, device=device)
    acc1 = torch.zeros(2, dtype=torch.int64, device=device)
    acc2 = torch.zeros((1, 2), dtype=torch.int64, device=device)
    fits = [k for k in keys if json.loads(k)["CHUNK"] * dd._MAX_CHUNKS >= words]
    return {
        "size": 4 * words,
        "grid_stride_ms": _event_time(lambda: dd.launch(one, acc1)) * 1e3,
        "chunk_grid_ms": {
            key: _event_time(
                lambda key=key: dd._run_bucket(one, None, [(0, words)], acc2, kernel, json.loads(key))
            )
            * 1e3
            for key in fits
        },
    }


def _manifest_digests(dd, kernel, key: str, device: str, size: int) -> list[dict]:
    """A sender's manifest: many separate tensors digested in one launch, the address-table kernel
    against the chunk grid over the same tensors as segments of one address range. Sets the module's
    CHUNK_CONFIG to `key`, so device_digests runs the schedule the sweep chose."""
    from harness.manifest import as_bytes

    dd.CHUNK_CONFIG = json.loads(key)
    manifests = []
    for nbytes in (size, 4 * size):
        model = _model_like(nbytes, device, seed=7, n=max(8, nbytes >> 24))
        raws = [as_bytes(t) for t in model.values()]
        words = [dd._words(r) for r in raws]
        plan = dd._as_segments(words)
        acc = torch.zeros((len(words), 2), dtype=torch.int64, device=device)
        want = [dd.reference_digest(r) for r in raws]
        manifests.append(
            {
                "size": nbytes,
                "tensors": len(words),
                "address_table_kernel_ms": _event_time(lambda: dd._run_many(words, acc)) * 1e3,
                "chunk_grid_ms": _event_time(lambda: dd._run_bucket(plan[0], None, plan[1], acc, kernel))
                * 1e3
                if plan
                else None,
                "device_digests_host_ms": _timed(lambda: dd.device_digests(raws)) * 1e3,
                "wrong": sum(g != w for g, w in zip(dd.device_digests(raws), want, strict=True)),
            }
        )
        del model, raws, words
    return manifests


VARIANTS = {"digests": digests_on_device, "digest_sweep": digest_sweep}


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harness.gpu_check",
        description="Device digest kernel timings and the bucket kernel's schedule sweep (one GPU). "
        "The product's GPU run is .ci/gpu-run.sh (weightsync bench/certify --device cuda).",
    )
    parser.add_argument("--out", required=True, help="folder for gpu_results.json")
    parser.add_argument(
        "--only", nargs="*", choices=list(VARIANTS), default=None, help="variants to run (default: all)"
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "python": sys.version.split()[0],
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    results: dict = {"environment": env}
    for name, fn in VARIANTS.items():
        if args.only is not None and name not in args.only:
            continue
        t0 = time.time()
        try:
            results[name] = fn()
        except Exception as exc:  # noqa: BLE001 - one variant failing must not hide the other
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"{name}: {time.time() - t0:.1f}s", flush=True)
        (out / "gpu_results.json").write_text(json.dumps(results, indent=2, default=str))
    print(json.dumps({k: v for k, v in results.items() if k != "environment"}, indent=1, default=str)[-6000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())

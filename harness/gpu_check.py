"""Every GPU variant in one call: ceilings, NCCL broadcast, CUDA IPC, delta on GPU, and the
conformance suite over the GPU backends. Writes JSON + Markdown under --out.

    python -m harness.gpu_check --out $OUT          # on a machine with 2 GPUs

Method (device README's METHOD.md): ceilings measured in the same run (device-to-device copy, bare
NCCL broadcast); timings with CUDA synchronisation around the region, warm-up first, median of
repeats; every timed result checked bit for bit; payloads random, never zeros.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from harness.manifest import Manifest
from harness.paths import delta_codec as codec

SIZES = [64 << 20, 256 << 20, 1 << 30]
BCAST_SIZES = [*SIZES, 4 << 30, 14 << 30]  # up to a 14 GiB model (7B parameters in bf16)
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


def _payload(nbytes: int, device, seed=0, n=8) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    per = nbytes // 2 // n
    return {f"w{i}": torch.randn(per, generator=gen, device=device).to(torch.bfloat16) for i in range(n)}


def copy_ceiling() -> list[dict]:
    rows = []
    for size in SIZES:
        src = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda:0")
        dst = torch.empty_like(src)
        t = _timed(lambda: dst.copy_(src))
        rows.append(
            {"size": size, "time_s": t, "gbs_read_plus_write": 2 * size / t / 1e9, "gbs": size / t / 1e9}
        )
    return rows


def _model_like(nbytes: int, device: str, seed: int, n: int) -> dict[str, torch.Tensor]:
    """`n` bf16 tensors of random values summing to `nbytes`: a model's worth of weights."""
    return _payload(nbytes, device, seed=seed, n=n)


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


def _bcast_worker(rank: int, port: int, queue) -> None:
    from harness.paths.broadcast import broadcast_buckets, make_group

    torch.cuda.set_device(rank)
    group = make_group(
        "nccl",
        "127.0.0.1",
        port,
        rank,
        2,
        120.0,
        store=torch.distributed.TCPStore(
            "127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=120)
        ),
    )
    out = []
    for size in BCAST_SIZES:
        # bare NCCL broadcast of one buffer: the ceiling
        buf = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda")
        bare = _timed(lambda: group.broadcast(buf, 0).wait())
        del buf
        # the path: pack (rank 0), broadcast the bucket, unpack typed copies (rank 1), bucket = 64 MiB
        weights = _payload(
            size, "cuda", seed=size % 997, n=max(8, size >> 26)
        )  # ~64 MiB tensors, like a model
        manifest = Manifest.build(1, weights, 64 << 20)
        received: dict = {}

        def path_once():  # the path's own double-buffered loop (harness.paths.broadcast)
            buckets = (
                (
                    manifest.pack_bucket(b, weights, device="cuda")
                    if rank == 0
                    else torch.empty(bsize, dtype=torch.uint8, device="cuda"),
                    f"bucket {b}",
                )
                for b, bsize in enumerate(manifest.bucket_sizes)
            )
            broadcast_buckets(
                group,
                buckets,
                (lambda b, bb: received.update(manifest.unpack_bucket(b, bb))) if rank == 1 else None,
            )

        t_path = _timed(path_once)
        wrong = len(manifest.wrong(received)) if rank == 1 else 0
        # end to end as a trainer pays it: the manifest's digests (rank 0), the path, the receiver's
        # verification (rank 1), and its answer back (an all-reduce of #wrong: rank 0's clock stops there)
        flag = torch.zeros(1, dtype=torch.int64, device="cuda")

        def e2e_once():
            m = Manifest.build(1, weights, 64 << 20) if rank == 0 else manifest
            received.clear()
            path_once()
            flag.fill_(len(m.wrong(received)) if rank == 1 else 0)
            group.allreduce([flag]).wait()

        t_e2e = _timed(e2e_once)
        e2e_wrong = int(flag.item())
        t_build = _timed(lambda: Manifest.build(1, weights, 64 << 20)) if rank == 0 else None
        t_verify = _timed(lambda: manifest.verify_all(received)) if rank == 1 else None
        out.append(
            {
                "size": manifest.total_bytes,
                "tensors": len(weights),
                "bare_nccl_s": bare,
                "path_s": t_path,
                "e2e_s": t_e2e,
                "digest_build_s": t_build,
                "verify_s": t_verify,
                "wrong": wrong,
                "e2e_wrong": e2e_wrong,
                "digest": manifest.entries[0].digest.split(":")[0]
                if ":" in manifest.entries[0].digest
                else "xxh3",
            }
        )
        del weights, received, manifest
        torch.cuda.empty_cache()
    queue.put((rank, out))


def nccl_broadcast() -> list[dict]:
    if torch.cuda.device_count() < 2:
        return [{"skipped": f"needs 2 GPUs (one rank each), this machine has {torch.cuda.device_count()}"}]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29000 + os.getpid() % 1000
    procs = [ctx.Process(target=_bcast_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    rows = []
    for r0, r1 in zip(results[0], results[1]):
        size = r0["size"]
        rows.append(
            {
                "size": size,
                "tensors": r0["tensors"],
                "digest": r0["digest"],
                "path_s": r0["path_s"],
                "path_gbs": size / r0["path_s"] / 1e9,
                "bare_nccl_gbs": size / r0["bare_nccl_s"] / 1e9,
                "ratio": r0["bare_nccl_s"] / r0["path_s"],
                "e2e_s": r0["e2e_s"],
                "e2e_gbs": size / r0["e2e_s"] / 1e9,
                "e2e_ratio": r0["bare_nccl_s"] / r0["e2e_s"],
                "digest_build_s": r0["digest_build_s"],
                "verify_s": r1["verify_s"],
                "wrong": r1["wrong"],
                "e2e_wrong": r1["e2e_wrong"],
            }
        )
    return rows


def _ipc_worker(handle_info: dict, device: str, queue, chunk_config: dict | None = None) -> None:
    from harness import device_digest as dd
    from harness.paths.ipc import IpcReceiver

    if chunk_config:  # the sweep's fastest schedule, where this run measured one
        dd.CHUNK_CONFIG = chunk_config

    try:
        manifest = Manifest.from_json(handle_info["manifest"])
        receiver = IpcReceiver(engine=None, device=device)
        receiver.fuse_verify = False

        def once():
            return receiver._receive(manifest, handle_info)

        t = _timed(once, repeats=5)
        got = once()
        wrong = len(manifest.wrong(got))
        t_verified = _timed(
            lambda: manifest.verify_all(once()), repeats=5
        )  # copy, then a second pass to verify
        receiver.fuse_verify = True

        def fused_once():  # copy and digest in one pass; whatever was not covered is verified after
            receiver.verified_in_transfer = set()
            got = once()
            manifest.verify_all({n: t for n, t in got.items() if n not in receiver.verified_in_transfer})
            return got

        t_fused = _timed(fused_once, repeats=5)
        fused_all = len(receiver.verified_in_transfer) == len(manifest.entries)
        queue.put(
            {
                "device": device,
                "time_s": t,
                "verified_time_s": t_verified,
                "fused_verified_time_s": t_fused,
                "fused_covered_every_tensor": fused_all,
                "wrong": wrong,
            }
        )
    except Exception as exc:  # noqa: BLE001 - reported in the results
        queue.put({"device": device, "error": f"{type(exc).__name__}: {exc}"})


def cuda_ipc(chunk_config: dict | None = None) -> list[dict]:
    from harness.paths.ipc import IpcSender

    ctx = mp.get_context("spawn")
    rows = []
    for size in SIZES:
        sender = IpcSender("cuda:0", bucket_bytes=1 << 40)
        weights = _payload(size, "cuda:0", seed=3)
        info = sender.prepare(1, weights)
        for device in ("cuda:0", "cuda:1")[: torch.cuda.device_count()]:  # same GPU, peer GPU
            queue = ctx.Queue()
            p = ctx.Process(target=_ipc_worker, args=(info, device, queue, chunk_config))
            p.start()
            res = queue.get(timeout=300)
            p.join(60)
            res["size"] = Manifest.from_json(info["manifest"]).total_bytes
            if "time_s" in res:
                res["gbs"] = res["size"] / res["time_s"] / 1e9
                res["verified_gbs"] = res["size"] / res["verified_time_s"] / 1e9
                res["fused_verified_gbs"] = res["size"] / res["fused_verified_time_s"] / 1e9
                res["verify_share_fused"] = res["fused_verified_time_s"] / res["time_s"] - 1
            rows.append(res)
        sender.complete(True)
        # after release, the handle must be refused or at least never deliver bytes that pass the token
        queue = ctx.Queue()
        p = ctx.Process(target=_ipc_worker, args=(info, "cuda:0", queue))
        p.start()
        stale = queue.get(timeout=300)
        p.join(60)
        rows.append({"size": size, "device": "stale handle", **stale})
    return rows


def delta_on_gpu() -> list[dict]:
    rows = []
    for fraction in (0.01, 0.1):
        gen = torch.Generator(device="cuda").manual_seed(5)
        old = torch.randn(256 << 20 >> 1, generator=gen, device="cuda").to(torch.bfloat16)
        new = old.clone()
        idx = torch.randperm(old.numel(), generator=gen, device="cuda")[: int(fraction * old.numel())]
        new[idx] = (new[idx].float() + 1).to(torch.bfloat16)
        state: dict = {}

        def extract():
            i = codec.changed_indices(old, new)
            state["enc"], state["vals"] = codec.encode_indices(i, old.numel()), codec.gather_values(new, i)

        def apply():
            state["out"] = codec.apply_patch(
                old, codec.decode_indices(state["enc"], old.numel()), state["vals"]
            )

        t_ex, t_ap = _timed(extract), _timed(apply)
        gb = old.numel() * 2 / 1e9
        exact = torch.equal(codec.int_view(state["out"]), codec.int_view(new))
        rows.append(
            {
                "fraction": fraction,
                "gb": gb,
                "extract_gb_per_s": gb / t_ex,
                "apply_gb_per_s": gb / t_ap,
                "moved_over_dense": (state["enc"].data.numel() + state["vals"].numel()) / (old.numel() * 2),
                "encoding": state["enc"].encoding,
                "exact": exact,
            }
        )
    return rows


GPU_BACKENDS = (
    "harness.backends.broadcast:make_nccl_backend",
    "harness.backends.ipc:make_cuda_backend",
    "harness.backends.delta:make_nccl_backend",
)


def _stop(proc: subprocess.Popen, term_grace_s: float = 10.0) -> None:
    """Stop a pytest run that overran. SIGTERM first: the weightsync plugin records the running test as
    failed ('hung: stopped after N s in <test>; rank 1 (pid ..) in 'poll' for X s; stacks in <log>') and
    dumps every thread's stack; a run that cannot act on it gets SIGABRT (faulthandler's stacks), then
    SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, term_grace_s), (signal.SIGABRT, 15.0)):
        proc.send_signal(sig)
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            pass
    proc.kill()
    proc.wait()


def conformance(out: Path, timeout_s: float) -> list[dict]:
    """The conformance suite over each GPU backend, the three runs side by side."""
    runs = []
    one_gpu = torch.cuda.device_count() < 2  # NCCL refuses two ranks on one GPU: only IPC runs there
    for name in GPU_BACKENDS:
        if one_gpu and "ipc" not in name:
            continue
        slug = name.split(":")[0].rsplit(".", 1)[-1] + "-" + name.split(":")[1]
        results = out / f"conformance-{slug}.json"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "suites/conformance",
            "-q",
            "-p",
            "harness.pytest_plugin",
            "-p",
            "no:cacheprovider",
            f"--weightsync-backend={name}",
            "--weightsync-receivers=1",
            f"--weightsync-results={results}",
            "--timeout=300",
            "--durations=5",
            f"--basetemp={out / ('tmp-' + slug)}",
            "--deselect",
            "suites/conformance/test_torchrun.py",
            "--deselect",
            "suites/conformance/test_supervision.py",
        ]
        log = open(out / f"pytest-{slug}.log", "w")  # noqa: SIM115 - closed below
        env = {**os.environ, "PYTHONFAULTHANDLER": "1"}  # SIGABRT on timeout dumps every thread's stack
        runs.append(
            (
                name,
                results,
                log,
                time.time(),
                subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env),
            )
        )
    rows = []
    for name, results, log, t0, proc in runs:
        try:
            proc.wait(timeout=max(1.0, timeout_s - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            _stop(proc)
        log.close()
        data = json.loads(results.read_text()) if results.exists() else {"tests": {}}
        statuses = [t.get("status") for t in data["tests"].values()]
        rows.append(
            {
                "backend": name,
                "exit": proc.returncode,
                "seconds": round(time.time() - t0, 1),
                "passed": statuses.count("passed"),
                "failed": statuses.count("failed"),
                "not_supported": statuses.count("not_supported"),
                "complete": data.get("complete", False),
                "stopped_in": data.get("running"),
                "failures": {
                    k: v.get("message", "")[-600:]
                    for k, v in data["tests"].items()
                    if v.get("status") == "failed"
                },
            }
        )
    return rows


def _swept(results: dict) -> dict | None:
    """The sweep's fastest schedule, where this run measured one (a failed variant holds only "error")."""
    best = results.get("digest_sweep", {}).get("best")
    return json.loads(best) if best else None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", nargs="*", default=None, help="variants to run (default: all)")
    parser.add_argument("--conformance-timeout", type=float, default=420.0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "python": sys.version.split()[0],
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
    }
    try:
        env["topology"] = subprocess.run(
            ["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        env["topology"] = "n/a"
    results: dict = {"environment": env}
    for name, fn in (
        ("copy_ceiling", copy_ceiling),
        ("digests", digests_on_device),
        ("nccl_broadcast", nccl_broadcast),
        ("digest_sweep", digest_sweep),
        ("cuda_ipc", lambda: cuda_ipc(_swept(results))),
        ("delta_gpu", delta_on_gpu),
    ):
        if args.only is not None and name not in args.only:
            continue
        t0 = time.time()
        try:
            results[name] = fn()
        except Exception as exc:  # noqa: BLE001 - one variant failing must not hide the others
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"{name}: {time.time() - t0:.1f}s", flush=True)
        (out / "gpu_results.json").write_text(json.dumps(results, indent=2, default=str))
    if args.only is None or "conformance" in args.only:
        results["conformance"] = conformance(out, args.conformance_timeout)
    (out / "gpu_results.json").write_text(json.dumps(results, indent=2, default=str))
    print(json.dumps({k: v for k, v in results.items() if k != "environment"}, indent=1, default=str)[-6000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())

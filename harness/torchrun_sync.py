"""The broadcast path as torchrun runs it: the same sender and receiver code, one process per rank,
on one host or many. Rank 0 is the trainer; every other rank serves a reference engine.

    torchrun --nproc-per-node=3 -m harness.torchrun_sync --steps 5
    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-endpoint=HOST:29500 -m harness.torchrun_sync

With no control plane between hosts, update_info travels as a small JSON broadcast on the same group
before the buckets. Every receiver then checks what its engine serves against the manifest's
digests, and the ranks sum their wrong-tensor counts: the trainer prints one table and exits 1 if
any tensor anywhere is wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from harness.manifest import Manifest
from harness.paths.broadcast import BroadcastReceiver, BroadcastSender, broadcast_one
from harness.registry import make_engine
from harness.trainer import ReferenceTrainer


def _broadcast_json(group, obj, device) -> dict:
    """Rank 0's JSON object on every rank (length first, then the bytes)."""
    data = json.dumps(obj).encode() if obj is not None else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    broadcast_one(group, size, "update_info length")
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        if obj is not None
        else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    )
    broadcast_one(group, buf, "update_info")
    return json.loads(bytes(buf.cpu().numpy()))


def _wrong_tensors(engine, manifest: Manifest) -> int:
    live = engine.read_weights()
    return len(manifest.wrong(live))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--engine", default="reference-bf16")
    parser.add_argument("--backend", default="nccl" if torch.cuda.is_available() else "gloo")
    parser.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args(argv)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    torch.set_num_threads(1)
    engine = make_engine(args.engine, None)  # the trainer uses its spec; receivers serve it

    if rank == 0:
        sender = BroadcastSender(
            world - 1, args.backend, timeout_s=args.timeout_s, addr=addr, port=port, local_rank=local_rank
        )
        sender.init()
        group, device = sender.group(), sender.device
        trainer = ReferenceTrainer(engine.weight_spec(), seed=0)
        print(
            f"{'step':>5} {'version':>8} {'bytes':>12} {'time(ms)':>9} {'GB/s':>7} {'#wrong':>7}", flush=True
        )
    else:
        receiver = BroadcastReceiver(engine)
        receiver.init_transfer_engine(
            {
                "master_addr": addr,
                "master_port": port,
                "world_size": world,
                "rank": rank,
                "local_rank": local_rank,
                "backend": args.backend,
                "timeout_s": args.timeout_s,
            }
        )
        group, device = receiver._group, receiver.device

    failures = 0
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        if rank == 0:
            version, weights = trainer.step()
            info = _broadcast_json(group, sender.prepare(version, weights), device)
            sender.transmit()
        else:
            info = _broadcast_json(group, None, device)
            receiver.start_weight_update()
            receiver.update_weights(info)
            receiver.finish_weight_update(info["manifest"]["version"])
        manifest = Manifest.from_json(info["manifest"])
        wrong = torch.tensor(
            [0 if rank == 0 else _wrong_tensors(engine, manifest)], dtype=torch.int64, device=device
        )
        group.allreduce(wrong).wait()  # also the end-of-step barrier
        elapsed = time.perf_counter() - t0
        failures += int(wrong.item())
        if rank == 0:
            gbs = manifest.total_bytes / elapsed / 1e9
            print(
                f"{step:>5} {manifest.version:>8} {manifest.total_bytes:>12} {elapsed * 1e3:>9.2f} {gbs:>7.3f} "
                f"{int(wrong.item()):>7}",
                flush=True,
            )
    if rank == 0:
        print(
            f"{'OK' if failures == 0 else 'FAIL'}: {args.steps} versions to {world - 1} receiver rank(s), "
            f"#wrong {failures}",
            flush=True,
        )
    engine.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

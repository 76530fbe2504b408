"""The resharded sync's third data plane, for ranks that share one host (one GPU): no message at all.
Each trainer rank writes its Shard(0) rows into a buffer of its own that other processes can map (a
/dev/shm file on the CPU, a CUDA allocation shared by its IPC handle on a GPU) and names it in the
world's store; each engine rank maps the buffers of the trainer ranks its plan reads from and copies
its planned slices straight into its shards (a row-parallel column band read strided, nothing packed),
then marks each buffer read. The trainer rank's sync ends when every engine rank of every replica that
reads from it has marked it, so its buffer is never refilled under a reader.

    store keys (under the world's prefix)   <sync>/shard-<s>          trainer rank s: {ref, layout}
                                            <sync>/read-<s>-<d>-<q>   engine rank d of replica q read s: "" or its error

Every wait is bounded by the world's transfer timeout; a trainer rank that never publishes, or an engine
rank that never reads, is named with the key it left unset."""

from __future__ import annotations

import datetime
import json
import os
import secrets
from collections.abc import Mapping

import torch
import torch.distributed as dist

from harness.api import ManifestMismatch, TransferError
from harness.reshard.gpu_bench import views
from harness.reshard.layout import DTYPES
from harness.reshard.plan import ReshardPlan

#: /dev/shm files of the trainer ranks' shards: named as the ipc path names its segments (`wsync-<pid>-`),
#: so the leak checks count them and a dead rank's file is swept (harness.paths.ipc)
SHM_DIR = "/dev/shm"
ALIGN = 256  # each tensor starts on a 256-byte boundary (a device copy's best alignment)


def _shard_key(sync: str, s: int) -> str:
    return f"{sync}/shard-{s}"


def _read_key(sync: str, s: int, d: int, q: int) -> str:
    return f"{sync}/read-{s}-{d}-{q}"


def sync_device(t: torch.Tensor) -> None:
    """Another process reads or overwrites these bytes next: the copies must have landed (no stream
    orders work across processes)."""
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


class SharedBuffer:
    """A flat buffer on `device` that other processes of this host map: a /dev/shm file
    (`wsync-<pid>-reshard-<label>-<hex>`) on the CPU, a CUDA allocation shared by its IPC handle on a GPU.
    Kept across versions while its size holds and, on the CPU, its file is still there at that size (a
    fresh file costs a page fault per page on every sync); `ref` is what another process opens it by
    (`open_ref`)."""

    def __init__(self, label: str, device: str | torch.device = "cpu"):
        self.label, self.device = label, torch.device(device)
        self.buf: torch.Tensor | None = None
        self.ref: dict | None = None
        self.path: str | None = None

    def get(self, nbytes: int) -> torch.Tensor:
        """The buffer, of `nbytes`: the last one again where it still holds, else a new one."""
        if self.buf is not None and self.buf.numel() == nbytes and self._file_holds(nbytes):
            return self.buf
        self.release()
        if self.device.type == "cuda":
            from harness.paths.ipc import cuda_handle

            self.buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.ref = {"cuda": cuda_handle(self.buf)}
        else:
            self.path = os.path.join(
                SHM_DIR, f"wsync-{os.getpid()}-reshard-{self.label}-{secrets.token_hex(6)}"
            )
            with open(self.path, "wb") as f:
                f.truncate(nbytes)
            self.buf = torch.from_file(self.path, shared=True, size=nbytes, dtype=torch.uint8)
            self.ref = {"path": self.path, "size": nbytes}
        return self.buf

    def _file_holds(self, nbytes: int) -> bool:
        if self.path is None:
            return True
        try:
            return os.path.getsize(self.path) == nbytes
        except FileNotFoundError:  # removed by someone else since: a new one
            return False

    def release(self) -> None:
        self.buf, self.ref = None, None
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:  # swept by someone else: nothing left to release
                pass
            self.path = None


class TrainerShardBuffer(SharedBuffer):
    """Trainer rank `rank`'s own flat buffer of its local shards."""

    def __init__(self, rank: int, device: str = "cpu"):
        super().__init__(f"shard{rank}", device)

    def fill(self, local: Mapping[str, torch.Tensor]) -> tuple[dict, dict[str, list]]:
        """Copy `local` ({name: this rank's rows}) into the buffer; (ref, layout {name: [offset, shape]})."""
        layout, off = {}, 0
        for name, t in local.items():
            layout[name] = [off, list(t.shape)]
            off += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        buf = self.get(max(off, 1))
        dtype = next(iter(local.values())).dtype if local else torch.uint8
        for name, view in views(buf, layout, dtype).items():
            view.copy_(local[name])
        sync_device(buf)
        return self.ref, layout


def open_ref(ref: Mapping) -> torch.Tensor:
    """The flat bytes a trainer rank published (`TrainerShardBuffer.ref`), mapped, not copied."""
    if "cuda" in ref:
        from harness.paths.ipc import open_cuda_handle

        return open_cuda_handle(ref["cuda"])
    try:
        return torch.from_file(ref["path"], shared=True, size=ref["size"], dtype=torch.uint8)
    except (RuntimeError, OSError) as exc:
        raise TransferError(f"cannot map trainer shard file {ref.get('path')!r}: {exc}") from None


def publish(
    store: dist.Store,
    sync: str,
    plan: ReshardPlan,
    rank: int,
    buffer: TrainerShardBuffer,
    local: Mapping[str, torch.Tensor],
    replicas: int,
    timeout_s: float,
) -> int:
    """Trainer `rank`'s side of one sync: fill its buffer, name it, wait until every engine rank (of each
    of `replicas`) whose plan reads from it has read it. Returns the bytes read out of it."""
    ref, layout = buffer.fill(local)
    store.set(_shard_key(sync, rank), json.dumps({"ref": ref, "layout": layout}))
    sends = plan.sends_of(rank)
    readers = sorted({t.dst for _, t in sends})
    keys = [_read_key(sync, rank, d, q) for d in readers for q in range(replicas)]
    if keys:
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout_s))
        except Exception as exc:  # the store's timeout error: name who did not read
            missing = [k.split("/")[-1] for k in keys if not store.check([k])]
            raise TransferError(
                f"trainer rank {rank}: engine ranks did not read its shards within {timeout_s:g}s "
                f"(unset: {', '.join(missing) or 'none'}): {type(exc).__name__}: {str(exc)[:200]}"
            ) from exc
    return sum(t.nbytes for _, t in sends) * replicas


class OpenedBuffers:
    """A process's mappings of other processes' `SharedBuffer`s, one per slot (an engine rank's: one per
    trainer rank; a trainer rank's: the trainer's staging buffer), kept while the slot's buffer stays the
    same: the whole ref is the key (a new CUDA buffer may lie in the same allocation at another offset),
    and opening a CUDA IPC handle costs a driver call per sync otherwise."""

    def __init__(self):
        self._open: dict[object, tuple[str, torch.Tensor]] = {}

    def get(self, slot: object, ref: Mapping) -> torch.Tensor:
        key = json.dumps(ref, sort_keys=True)
        if slot not in self._open or self._open[slot][0] != key:
            self._open.pop(slot, None)  # the last mapping closed before the next opens
            self._open[slot] = (key, open_ref(ref))
        return self._open[slot][1]


def read(
    store: dist.Store,
    sync: str,
    plan: ReshardPlan,
    rank: int,
    shards,
    replica: int,
    timeout_s: float,
    opened: OpenedBuffers,
) -> int:
    """Engine `rank`'s (of `replica`) side of one sync: copy every planned slice out of the trainer ranks'
    buffers into `shards` (`sync.EngineShards`); the bytes copied. Each buffer it read from (or meant to)
    is marked read, with the error if it failed, so no trainer rank waits out its timeout on it."""
    todo = plan.receives_of(rank)
    sources = sorted({t.src for _, t in todo})
    dtype = DTYPES[plan.trainer.dtype]
    error = ""
    try:
        mapped = {}
        for s in sources:
            try:
                store.wait([_shard_key(sync, s)], datetime.timedelta(seconds=timeout_s))
            except Exception as exc:  # the store's timeout error
                raise TransferError(
                    f"engine rank {rank}: trainer rank {s} published no shards within {timeout_s:g}s: "
                    f"{type(exc).__name__}: {str(exc)[:200]}"
                ) from exc
            meta = json.loads(store.get(_shard_key(sync, s)))
            mapped[s] = views(opened.get(s, meta["ref"]), meta["layout"], dtype)
        moved, dst = 0, None
        for i, t in todo:
            src = mapped[t.src].get(t.source)
            if src is None:
                raise ManifestMismatch(
                    f"engine rank {rank}: trainer rank {t.src} holds no {t.source!r}: {t.describe()}"
                )
            src = src[t.src_rows[0] : t.src_rows[1]]
            if t.cols is not None:
                src = src[:, t.cols[0] : t.cols[1]]  # a strided band, read in place
            dst = shards.tensors[t.dest][t.dst_rows[0] : t.dst_rows[1]]
            if tuple(src.shape) != tuple(dst.shape) or src.numel() * src.element_size() != t.nbytes:
                # the plan cuts past a trainer shard: never copy a short slice
                raise ManifestMismatch(
                    f"engine rank {rank}: transfer #{i} carries {t.nbytes} B, trainer rank {t.src}'s rows give "
                    f"{src.numel() * src.element_size()} B for {dst.numel() * dst.element_size()} B of room: "
                    f"{t.describe()}"
                )
            dst.copy_(src)
            moved += t.nbytes
        if dst is not None:  # the trainer rank may refill its buffer once marked read
            sync_device(dst)
        return moved
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"[:300]
        raise
    finally:
        for s in sources:
            store.set(_read_key(sync, s, rank, replica), error)

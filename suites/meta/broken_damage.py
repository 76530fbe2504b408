"""Deliberately broken senders for the damage done between syncs (issue 38, items 1-2): each heals the
next push, so "the next push commits" alone passes it; the fault cells must see what else it did.
(The base-ignoring delta sender of item 3 is suites.meta.broken:make_base_keeping_delta_backend.)"""

from __future__ import annotations

import os
import shutil
from multiprocessing import shared_memory
from pathlib import Path

import safetensors.torch

from harness.api import TransferError
from harness.backends.disk import DiskBackend
from harness.backends.ipc import IpcBackend
from harness.paths import disk as disk_path
from harness.paths import ipc as ipc_path
from harness.paths.disk import DiskSender
from harness.paths.ipc import IpcSender
from suites.meta.broken import SwapsSenderClass, patched


class _NameReclaimingIpcSender(IpcSender):
    """Finding its segment's name taken by another process's file, deletes that file and makes its own
    segment again under the name (names kept stable "for the receivers' logs"): the next push commits,
    and whoever wrote that file has lost it."""

    def _fit_segments(self, sizes):
        for b, shm in enumerate(self._segments[: len(sizes)]):
            damage = ipc_path._damage(shm)
            if damage and "replaced" in damage:
                name, size = shm.name, os.fstat(shm._fd).st_size
                ipc_path._abandon(shm)
                os.unlink(f"/dev/shm/{name}")  # the defect under test: the file is not the trainer's
                fresh = shared_memory.SharedMemory(name=name, create=True, size=size)
                ipc_path._reserve(fresh, name)
                self._segments[b] = fresh
        super()._fit_segments(sizes)


class NameReclaimingIpcBackend(SwapsSenderClass, IpcBackend):
    name = "broken-name-reclaiming-ipc"
    broken_sender = _NameReclaimingIpcSender


def make_name_reclaiming_ipc_backend():
    return NameReclaimingIpcBackend()


def _sibling_write_checkpoint(root, manifest, named_tensors, attempt=0, tap=None):
    """The writer's commit protocol, under `root` as given (here `<newest>/..`: a path through the newest
    directory the sender listed), and the writer's stock error: what failed, never which path."""
    final = disk_path.version_dir(root, manifest.version, attempt)
    tmp = root / f".{final.name}{disk_path.TMP_MARK}{os.getpid()}"
    try:
        tmp.mkdir()
        for bucket in range(len(manifest.bucket_sizes)):
            shard = {
                e.name: named_tensors[e.name].detach().contiguous().clone()
                for e in manifest.bucket_entries(bucket)
            }
            safetensors.torch.save_file(shard, str(tmp / disk_path.shard_name(bucket)))
        (tmp / disk_path.MANIFEST_FILE).write_text(manifest.dumps())
        os.rename(tmp, final)
    except OSError as exc:  # ENOENT: the newest directory is gone, and the path through it with it
        shutil.rmtree(tmp, ignore_errors=True)
        raise TransferError(
            f"writing version {manifest.version} failed: {exc.strerror or exc}; nothing was published and "
            "the partial files were removed"
        ) from exc
    return Path(os.path.normpath(final))


class _ListingDiskSender(DiskSender):
    """Keeps a listing of the version directories it published and writes each version next to the
    newest of them (`<newest>/../v<version>`), never listing the run directory again: once a retention
    cleaner removed that directory, the path through it leads nowhere and every later push fails, its
    error the writer's stock phrase ("No such file or directory"), naming no directory."""

    def prepare(self, version, named_tensors):
        listing = self.__dict__.setdefault("listing", [])
        if not listing:
            info = super().prepare(version, named_tensors)
            listing.append(Path(info["path"]))
            return info
        with patched(
            disk_path,
            "write_checkpoint",
            lambda root, *a, **k: _sibling_write_checkpoint(listing[-1] / os.pardir, *a, **k),
        ):
            info = super().prepare(version, named_tensors)
        listing.append(Path(info["path"]))
        return info


class ListingDiskBackend(SwapsSenderClass, DiskBackend):
    name = "broken-listing-disk"
    broken_sender = _ListingDiskSender


def make_listing_disk_backend():
    return ListingDiskBackend()

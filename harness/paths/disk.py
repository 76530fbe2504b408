"""Checkpoint to disk and reload: safetensors shards on a (shared) filesystem.

Commit protocol of the writer: shards into a private temporary directory, each fsynced; the manifest
written last and fsynced; the directory fsynced, then renamed atomically to `v<version>`. A reader
that sees `v<version>` therefore sees a complete checkpoint, and it still verifies every digest.
"""

from __future__ import annotations

import collections
import os
import shutil
import threading
from collections.abc import Mapping
from pathlib import Path

import safetensors.torch
import torch

from harness import phases
from harness.api import (
    JSON,
    ManifestMismatch,
    Sender,
    Tap,
    TransferError,
)
from harness.manifest import Manifest
from harness.paths.base import StagingReceiver
from harness.procs import pid_alive

MANIFEST_FILE = "manifest.json"
DEFAULT_SHARD_BYTES = 256 << 20


def version_dir(root: Path, version: int, attempt: int = 0) -> Path:
    # one directory per attempt: a version the engines refused can be fixed and sent again
    return root / f"v{version:010d}.{attempt:04d}"


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def shard_name(bucket: int) -> str:
    return f"shard-{bucket:05d}.safetensors"


TMP_MARK = ".tmp-"  # a directory being written: `.<final name>.tmp-<writer pid>`


def sweep_abandoned(root: Path) -> list[Path]:
    """Remove the temporary directories of writers that died mid-write (their pid is gone)."""
    removed = []
    for d in root.glob(f".*{TMP_MARK}*"):
        pid = d.name.rsplit(TMP_MARK, 1)[1]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def _tap_file(tap: Tap, bucket: int, path: Path) -> None:
    """Hand a written shard to the interposer as a shared mapping; a cut truncates the file."""
    size = path.stat().st_size
    data = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
    keep = tap(bucket, data, str(path))
    del data
    if keep is not None and 0 <= keep < size and path.is_file():
        os.truncate(path, keep)


def write_checkpoint(
    root: Path,
    manifest: Manifest,
    named_tensors: Mapping[str, torch.Tensor],
    attempt: int = 0,
    tap: Tap | None = None,
) -> Path:
    """Write `manifest`'s version under `root` with the commit protocol above; returns its directory.
    A failure (a full disk, an exception in the trainer) removes what was written and publishes nothing."""
    final = version_dir(root, manifest.version, attempt)
    if final.exists():
        raise TransferError(f"checkpoint {final} already exists; a checkpoint directory is written once")
    tmp = root / f".{final.name}{TMP_MARK}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        seen_storage: set[int] = set()
        for bucket in range(len(manifest.bucket_sizes)):
            shard = {}
            for e in manifest.bucket_entries(bucket):
                t = named_tensors[e.name].detach().contiguous()
                ptr = t.untyped_storage().data_ptr()
                if t.numel() and ptr in seen_storage:  # tied weights: safetensors refuses shared storage
                    t = t.clone()
                seen_storage.add(ptr)
                shard[e.name] = t
            path = tmp / shard_name(bucket)
            with phases.phase("wire"):  # the file system is this path's wire
                safetensors.torch.save_file(shard, str(path), metadata={"version": str(manifest.version)})
                _fsync_file(path)
            if tap is not None:
                _tap_file(tap, bucket, path)
        mpath = tmp / MANIFEST_FILE
        mpath.write_text(manifest.dumps())
        _fsync_file(mpath)
        _fsync_dir(tmp)
        os.rename(tmp, final)
        _fsync_dir(root)
    except (OSError, safetensors.SafetensorError) as exc:  # ENOSPC comes as either
        shutil.rmtree(tmp, ignore_errors=True)
        raise TransferError(
            f"writing version {manifest.version} under {root} failed: {getattr(exc, 'strerror', None) or exc}; "
            "nothing was published and the partial files were removed"
        ) from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def read_checkpoint(directory: Path, manifest: Manifest) -> dict[str, torch.Tensor]:
    """Load every tensor of `manifest` from its shards (the caller verifies digests)."""
    out: dict[str, torch.Tensor] = {}
    for bucket in range(len(manifest.bucket_sizes)):
        path = directory / shard_name(bucket)
        try:
            with phases.phase("wire"):
                loaded = safetensors.torch.load_file(str(path))
        except (OSError, safetensors.SafetensorError) as exc:
            raise ManifestMismatch(f"version {manifest.version}: shard {path} unreadable: {exc}") from None
        for e in manifest.bucket_entries(bucket):
            if e.name in loaded:
                out[e.name] = loaded[e.name]
    return out


class Janitor:
    """Deletes retired checkpoint directories on a thread of its own, in the order given, so the trainer
    never waits for it (unlinking a version two behind took 17 ms per 64 MiB here, a quarter of the
    trainer's write). The thread exists only while there is something to delete."""

    def __init__(self) -> None:
        self._pending: collections.deque[Path] = collections.deque()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def discard(self, directory: Path) -> None:
        with self._lock:
            self._pending.append(directory)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="disk-janitor", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    self._thread = None
                    return
                directory = self._pending.popleft()
            shutil.rmtree(directory, ignore_errors=True)

    def settle(self) -> None:
        """Return once everything handed over so far is deleted."""
        while True:
            with self._lock:
                thread = self._thread
            if thread is None:
                return
            thread.join()


class DiskSender(Sender):
    """Writes each version once under `root/run-<n>/`; a reset starts a new run directory."""

    def __init__(self, root: str | Path, shard_bytes: int = DEFAULT_SHARD_BYTES, keep_versions: int = 2):
        self.root = Path(root)
        self.shard_bytes = shard_bytes
        self.keep_versions = keep_versions
        self._written: list[Path] = []
        self._run = 0
        self._attempts = 0
        self.janitor = Janitor()

    @property
    def run_dir(self) -> Path:
        return self.root / f"run-{self._run:04d}"

    def init(self) -> JSON:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        sweep_abandoned(self.run_dir)  # a trainer killed mid-write left its temporary directory
        return {"root": str(self.root)}

    def reset(self) -> None:
        for d in self._written:
            self.janitor.discard(d)
        self._written.clear()
        self._run += 1
        self.run_dir.mkdir(parents=True, exist_ok=True)

    def prepare(self, version: int, named_tensors: Mapping[str, torch.Tensor]) -> JSON:
        manifest = Manifest.build(version, named_tensors, self.shard_bytes)
        self._attempts += 1
        while version_dir(
            self.run_dir, version, self._attempts
        ).exists():  # a restarted trainer's earlier tries
            self._attempts += 1
        directory = write_checkpoint(self.run_dir, manifest, named_tensors, self._attempts, self.tap)
        self._written.append(directory)
        # old versions go once newer ones exist (in the background); readers of the newest are never disturbed
        while len(self._written) > self.keep_versions:
            self.janitor.discard(self._written.pop(0))
        return {"path": str(directory), "manifest": manifest.to_json()}

    def transmit(self) -> None:
        """Nothing to do: the checkpoint was committed by prepare()."""

    def settle(self) -> None:
        self.janitor.settle()

    def shutdown(self) -> None:
        self.janitor.settle()


class DiskReceiver(StagingReceiver):
    def __init__(self, engine):
        super().__init__(engine)
        self.root: Path | None = None

    def _init(self, init_info: JSON) -> None:
        if "root" not in init_info:
            raise ManifestMismatch("init_info for disk needs 'root'")
        self.root = Path(init_info["root"]).resolve()

    def _receive(self, manifest: Manifest, update_info: JSON) -> dict[str, torch.Tensor]:
        assert self.root is not None
        directory = Path(str(update_info.get("path", ""))).resolve()
        if not directory.is_relative_to(self.root):
            raise ManifestMismatch(f"checkpoint path {directory} is outside the allowed root {self.root}")
        mpath = directory / MANIFEST_FILE
        try:
            on_disk = Manifest.loads(mpath.read_bytes())
        except FileNotFoundError:
            raise ManifestMismatch(
                f"version {manifest.version}: {mpath} missing: checkpoint not committed"
            ) from None
        if on_disk != manifest:
            raise ManifestMismatch(
                f"version {manifest.version}: the checkpoint at {directory} (version {on_disk.version}) is not "
                "the one announced in update_info"
            )
        return read_checkpoint(directory, manifest)

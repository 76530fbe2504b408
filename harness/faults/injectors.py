"""The nemesis: faults injected into a running deployment, each with setup / arm / heal.

A fault knows what it needs from a backend (its ranks as processes, an interposable data plane, a
file-backed data plane) and says why it does not apply where it cannot; it never pretends. Where it
strikes is a `point` drawn from a seed (which receiver, how long after the call, which byte), so a
cell is rerun exactly by its seed. Workloads (harness.faults.cell) and checkers (harness.checks)
live elsewhere.

Why one file: the in-push fault kinds share one base (`Fault`: setup, arm, heal, points drawn from a seed) and one
context; each kind is 20-60 lines, and reading them side by side is how a new one is written.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from harness.api import Capabilities, Deployment, Receiver

COMMIT_FAIL_DIR_ENV = "WEIGHTSYNC_FAULT_DIR"  # where harness.faults.engines looks for its triggers
SEEDED = "seeded"  # the point a seed draws (receiver, call, delay, byte)


@dataclasses.dataclass
class FaultContext:
    """What an injector may touch: the deployment under test and the push it strikes."""

    deployment: Deployment
    workdir: Path
    rng: random.Random
    victim: int = 0  # the receiver index a receiver fault strikes
    #: the named point to strike (one of Fault.points()); None: drawn from `rng`
    point: str | None = None
    #: the trainer's /dev/shm segments that are not this cell's (a suite's open pools): never damaged
    segments_before: tuple[str, ...] = ()
    log: list[str] = dataclasses.field(default_factory=list)  # what was done, when (for the report)
    timers: list[threading.Timer] = dataclasses.field(default_factory=list)

    def note(self, what: str) -> None:
        self.log.append(f"{time.monotonic():.3f} {what}")

    def join_timers(self) -> None:
        """Wait until every armed strike has happened (it may land after the push returned)."""
        for t in self.timers:
            t.join()


@dataclasses.dataclass
class ForeignFile:
    """A file of another process's that a cell puts where the trainer can reach it (a name its segment
    held, space on its filesystem): whatever the trainer does about it, the file stays as its owner
    left it, the same inode holding the same bytes."""

    path: Path
    ino: int
    size: int
    sha256: str

    @classmethod
    def of(cls, path: str | Path) -> ForeignFile:
        path = Path(path)
        st = path.stat()
        return cls(path, st.st_ino, st.st_size, _sha256(path))

    def problems(self, when: str) -> list[str]:
        """What happened to the file (empty: intact, byte for byte), each line naming it."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return [
                f"{when}: another process's file {self.path} ({self.size} bytes, inode {self.ino}) is gone: "
                "the trainer removed a file that is not its own"
            ]
        if st.st_ino != self.ino:
            return [
                f"{when}: another process's file {self.path} (inode {self.ino}) was replaced by inode "
                f"{st.st_ino}: the trainer took a name held by a file that is not its own"
            ]
        if st.st_size != self.size or _sha256(self.path) != self.sha256:
            return [
                f"{when}: another process's file {self.path} changed ({st.st_size} bytes, was {self.size}; "
                "the bytes differ): the trainer wrote into a file that is not its own"
            ]
        return []


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class PointNotApplicable(Exception):
    """The named point does not exist in this push (no 'between two units' where one unit moved)."""


#: The family of a fault that kills the trainer itself: its cell runs the trainer in a child process.
TRAINER_PROCESS = "trainer-process"


class Fault(abc.ABC):
    """One kind of fault. `applies` gives the reason it cannot run here (None: it can)."""

    kind: str
    #: the error of the failed push must name the victim receiver's rank
    names_victim: bool = False
    #: the push must succeed despite the fault (a client rides out a cut connection by retrying)
    must_succeed: bool = False
    #: "in-push": strikes while a push runs; "between-syncs": damage done while nothing syncs;
    #: "trainer-process": the trainer itself dies, so its cell runs the trainer in a child process
    #: (harness.faults.trainer_kill) where the others run harness.faults.cell's
    family: str = "in-push"
    #: a fault of the control plane itself: the control column of the default selection runs these (its
    #: data plane is disk's, whose column runs the rest)
    control_plane: bool = False
    #: a failed push's error must carry one of these words (what was damaged); () : no such check
    must_name: tuple[str, ...] = ()

    def applies(self, backend: str, caps: Capabilities, deployment: Deployment) -> str | None:
        return None

    def points(self, caps: Capabilities) -> tuple[str, ...]:
        """The named points where this fault's effect changes (which party, which phase of the
        lifecycle, before / between / after the data plane's units): the default tier runs each once,
        deterministically; a seed draws a point of its own ('seeded')."""
        return (SEEDED,)

    def applies_to(self, caps: Capabilities) -> str | None:
        """What the claimed capabilities alone rule out, before anything is deployed (None: may apply)."""
        return None

    def setup(self, ctx: FaultContext) -> None:  # noqa: B027 - optional hook
        """Before the faulty push (after the first, clean one)."""

    @abc.abstractmethod
    def arm(self, ctx: FaultContext, tensors: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """Install the trigger for the next push; returns the tensors the trainer will push."""

    def disarm(self, ctx: FaultContext) -> None:  # noqa: B027 - optional hook
        """The faulty push returned: remove whatever trigger is left."""

    def heal(self, ctx: FaultContext) -> None:  # noqa: B027 - optional hook
        """Undo the fault (resume a stopped rank, free the disk...)."""

    def teardown(self, ctx: FaultContext) -> None:  # noqa: B027 - optional hook
        """After the cell: remove what setup built (mounts)."""

    def check(self, ctx: FaultContext) -> list[str]:
        """After heal: what this fault's own oracle finds wrong (e.g. an operation applied twice)."""
        return []

    def check_after_recovery(self, ctx: FaultContext) -> list[str]:
        """After the push that follows heal: what the oracle finds wrong then (another process's file,
        left alone by the faulty push, taken by the recovery)."""
        return []

    def describe(self, ctx: FaultContext) -> str:
        return self.kind


# ------------------------------------------------------------------------------------------ triggers
class _CallTrigger(Receiver):
    """Wraps the victim's receiver for one push: when `call` starts, `action` runs after `delay_s`
    on a timer thread while the call proceeds (so a kill lands mid-transfer); with `delay_s` None it
    runs first, before the call is forwarded (a rank gone before the call reaches it)."""

    def __init__(self, inner: Receiver, call: str, delay_s: float | None, action, ctx: FaultContext):
        self.inner, self.call, self.delay_s, self.action, self.ctx = inner, call, delay_s, action, ctx
        self.fired = False

    def _maybe_fire(self, name: str) -> None:
        if name != self.call or self.fired:
            return
        self.fired = True
        if self.delay_s is None:
            self.action()
        else:
            timer = threading.Timer(self.delay_s, self.action)
            timer.daemon = True
            self.ctx.timers.append(timer)
            timer.start()

    def init_transfer_engine(self, init_info):
        return self.inner.init_transfer_engine(init_info)

    def start_weight_update(self):
        self._maybe_fire("start_weight_update")
        return self.inner.start_weight_update()

    def update_weights(self, update_info):
        self._maybe_fire("update_weights")
        return self.inner.update_weights(update_info)

    def finish_weight_update(self, version):
        self._maybe_fire("finish_weight_update")
        return self.inner.finish_weight_update(version)

    def abort_weight_update(self):
        return self.inner.abort_weight_update()

    def shutdown(self):
        return self.inner.shutdown()


class _ProcessFault(Fault):
    """A signal to the victim receiver's rank at a point of the push: in start, before its first unit
    moves, between two units (a tap on the sender's data plane), after the last (before finish), or
    during finish. Named points strike the last receiver: when it fails in finish the others have
    committed. A seeded point draws the receiver, the call and a delay into it."""

    names_victim = True
    calls = ("update_weights", "finish_weight_update")
    #: named point -> (call whose start strikes, delay into it: None strikes before the call is forwarded)
    CALL_POINTS = {
        "in-start": ("start_weight_update", None),
        "before-transfer": ("update_weights", None),
        "before-finish": ("finish_weight_update", None),
        "during-finish": ("finish_weight_update", 0.0),
    }
    UNIT_POINT = "between-units"  # the sender reaches its second unit: the first has moved

    def applies(self, backend, caps, deployment):
        if not deployment.processes():
            return "the backend exposes no rank processes (Deployment.processes() is empty)"
        return None

    #: the named points this fault strikes at (a stall at each of these shows what a kill would not)
    NAMED = ("in-start", "before-transfer", "between-units", "before-finish", "during-finish")

    def points(self, caps):
        return tuple(p for p in self.NAMED if p != self.UNIT_POINT or caps.interposable)

    def arm(self, ctx, tensors):
        self.struck, self.point = False, ctx.point
        if ctx.point is None or ctx.point == SEEDED:
            ctx.victim = ctx.rng.randrange(len(ctx.deployment.handles))
            self.call = ctx.rng.choice(self.calls)
            self.delay_s = round(ctx.rng.uniform(0.0, 0.05), 4) if self.call == "update_weights" else 0.0
        else:
            ctx.victim = len(ctx.deployment.handles) - 1
            if ctx.point == self.UNIT_POINT:
                self.call, self.delay_s = None, None
                ctx.deployment.sender.tap = lambda unit, data, where: self._on_unit(ctx, unit)
                return tensors
            self.call, self.delay_s = self.CALL_POINTS[ctx.point]
        handle = ctx.deployment.handles[ctx.victim]
        self._handle, self._inner = handle, handle.receiver
        handle.receiver = _CallTrigger(
            handle.receiver, self.call, self.delay_s, lambda: self._strike(ctx), ctx
        )
        return tensors

    def _on_unit(self, ctx, unit: int) -> None:
        self.units = max(getattr(self, "units", 0), unit + 1)
        if unit >= 1 and not self.struck:
            self._strike(ctx)

    def disarm(self, ctx):
        if getattr(self, "_handle", None) is not None and self._handle.receiver.__class__ is _CallTrigger:
            self._handle.receiver = self._inner
        if self.call is None:
            ctx.deployment.sender.tap = None

    def heal(self, ctx):
        if not self.struck and self.call is None and getattr(self, "units", 0) == 1:
            raise PointNotApplicable(
                f"{self.describe(ctx)}: the data plane moved this version in one unit (no two to strike between)"
            )
        if not self.struck:  # the point was never reached: the cell tested nothing
            raise RuntimeError(f"{self.describe(ctx)}: the push never reached that point")

    def pid(self, ctx) -> int:
        return ctx.deployment.processes()[ctx.victim].pid

    def _strike(self, ctx) -> None:
        self.struck = True
        try:
            self.strike(ctx)
        except ProcessLookupError:
            ctx.note("the victim was already gone when the fault struck")

    @abc.abstractmethod
    def strike(self, ctx: FaultContext) -> None: ...

    def describe(self, ctx):
        if self.point not in (None, SEEDED):
            return f"{self.kind} receiver {ctx.victim} {self.point}"
        return f"{self.kind} receiver {ctx.victim} {getattr(self, 'delay_s', 0):g}s into {getattr(self, 'call', '?')}"


class ReceiverKill(_ProcessFault):
    """SIGKILL a receiver rank mid-transfer or mid-finish (a node lost, an OOM kill)."""

    kind = "receiver-kill"
    control_plane = True

    def strike(self, ctx):
        pid = self.pid(ctx)
        os.kill(pid, signal.SIGKILL)
        ctx.note(f"SIGKILL pid {pid}")


class ReceiverStall(_ProcessFault):
    """SIGSTOP a receiver rank past the timeout (a frozen host), SIGCONT at heal."""

    kind = "receiver-stall"
    control_plane = True
    # each stall cell waits out a timeout: the points where waiting differs (a call that never answers,
    # a collective half done, a commit half done); the others are a kill's
    NAMED = ("in-start", "between-units", "during-finish")

    def strike(self, ctx):
        self._stopped = self.pid(ctx)
        os.kill(self._stopped, signal.SIGSTOP)
        ctx.note(f"SIGSTOP pid {self._stopped}")

    def heal(self, ctx):
        pid = getattr(self, "_stopped", None)
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:  # the supervisor already killed it: what it should do
                pass
        super().heal(ctx)


class TrainerRankKill(ReceiverKill):
    """SIGKILL one of the trainer's own rank processes (an FSDP rank of a resharded sync: the sender is N
    processes) at a point of the push, struck through the last receiver's call as a receiver fault is."""

    kind = "trainer-rank-kill"
    control_plane = False
    names_victim = False  # the victim is no receiver: the error must name the trainer rank instead
    must_name = ("trainer rank",)

    def applies_to(self, caps):
        if not caps.trainer_ranks:
            return "the backend does not claim 'trainer_ranks' (its trainer is one process)"
        return None

    def applies(self, backend, caps, deployment):
        if not callable(getattr(deployment, "trainer_processes", None)):
            return "the trainer is one process (the deployment has no trainer_processes())"
        return None

    def pid(self, ctx) -> int:
        return ctx.deployment.trainer_processes()[-1].pid

    def describe(self, ctx):
        return f"{self.kind} {ctx.deployment.trainer_processes()[-1].name} {self.point or SEEDED}"


class TrainerRankStall(TrainerRankKill, ReceiverStall):
    """SIGSTOP one of the trainer's rank processes past the timeout, SIGCONT at heal."""

    kind = "trainer-rank-stall"
    NAMED = ReceiverStall.NAMED
    strike = ReceiverStall.strike
    heal = ReceiverStall.heal


class RaisingTensors(Mapping):
    """The trainer's tensors, raising on the k-th read: a trainer that fails mid-prepare or
    mid-transfer (an exception in the step, a CUDA error while packing)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], fail_at: int, ctx: FaultContext):
        self._tensors, self._fail_at, self._ctx, self.reads = tensors, fail_at, ctx, 0

    def __getitem__(self, name: str) -> torch.Tensor:
        self.reads += 1
        if self.reads == self._fail_at:
            self._ctx.note(f"trainer raises at read {self.reads} ({name})")
            raise RuntimeError(f"injected trainer failure while reading tensor {name!r} (read {self.reads})")
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


#: Named points of a trainer that fails while reading its n tensors (read k of about 2n: the
#: manifest reads each once, the transfer once more): before anything moved, halfway through the
#: transfer (the manifest is out, some bytes are), at the last read.
READ_POINTS = {
    "first-read": lambda n: 1,
    "mid-move": lambda n: n + max(n // 2, 1),
    "last-read": lambda n: 2 * n,
}


class TrainerRaise(Fault):
    """The trainer's tensor source raises at a seeded read mid-push (a bug or an out-of-memory in the
    trainer's own code): the push must fail, every engine keep its last version, the next push succeed."""

    kind = "trainer-raise"
    control_plane = True

    def points(self, caps):
        return tuple(READ_POINTS)

    def arm(self, ctx, tensors):
        # a sender reads each tensor once for the manifest and once more to move it
        n = len(tensors)
        self.fail_at = READ_POINTS[ctx.point](n) if ctx.point in READ_POINTS else ctx.rng.randint(1, 2 * n)
        return RaisingTensors(tensors, self.fail_at, ctx)

    def describe(self, ctx):
        return f"trainer-raise at tensor read {self.fail_at}"


class TrainerKill(Fault):
    """The trainer SIGKILLed mid-transfer, at a named tensor read of version 2. While the manifest is built
    or while bytes move; a new trainer on the same working directory takes over. Its cell is
    harness.faults.trainer_kill's: no rank outlives the trainer, nothing of it leaks, the new trainer's
    pushes land bit for bit."""

    kind = "trainer-kill"
    family = TRAINER_PROCESS

    def points(self, caps):
        return tuple(READ_POINTS)

    def arm(self, ctx, tensors):
        raise TypeError(f"{self.kind} arms nothing in a push: its cell kills the trainer process itself")


class _TapFault(Fault):
    """A fault on the data plane through the sender's interposer (`Sender.tap`)."""

    def applies_to(self, caps):
        return (
            None
            if caps.interposable
            else "the backend does not claim 'interposable' (its sender does not call Sender.tap)"
        )

    def applies(self, backend, caps, deployment):
        if not caps.interposable:
            return "the backend does not claim 'interposable' (its sender does not call Sender.tap)"
        return None

    def arm(self, ctx, tensors):
        self.unit = None
        ctx.deployment.sender.tap = lambda unit, data, where: self.on_unit(ctx, unit, data, where)
        return tensors

    def disarm(self, ctx):
        ctx.deployment.sender.tap = None

    @abc.abstractmethod
    def on_unit(self, ctx: FaultContext, unit: int, data: torch.Tensor, where: str | None) -> int | None: ...


class PayloadCorrupt(_TapFault):
    """One bit flipped deep inside the first unit of payload, after the digests were computed."""

    kind = "payload-corrupt"

    def on_unit(self, ctx, unit, data, where):
        if self.unit is not None or data.numel() == 0:
            return
        self.unit, self.byte, self.bit = (
            unit,
            ctx.rng.randrange(data.numel() // 2, data.numel()),
            ctx.rng.randrange(8),
        )
        data[self.byte] ^= 1 << self.bit
        ctx.note(f"bit {self.bit} of byte {self.byte} flipped in unit {unit} ({where or 'in flight'})")
        return

    def describe(self, ctx):
        return f"payload-corrupt unit {self.unit} byte {getattr(self, 'byte', '?')} bit {getattr(self, 'bit', '?')}"


class PayloadCut(_TapFault):
    """The payload cut at a byte of the first unit: what follows never arrives."""

    kind = "payload-cut"

    def on_unit(self, ctx, unit, data, where):
        if self.unit is not None or data.numel() == 0:
            return None
        self.unit, self.byte = unit, ctx.rng.randrange(0, data.numel())
        ctx.note(f"unit {unit} cut at byte {self.byte} of {data.numel()} ({where or 'in flight'})")
        return self.byte

    def describe(self, ctx):
        return f"payload-cut unit {self.unit} at byte {getattr(self, 'byte', '?')}"


class BlockedRead(_TapFault):
    """A shard whose read blocks forever (a hung network filesystem): the file becomes a FIFO."""

    kind = "blocked-read"
    names_victim = True

    def applies(self, backend, caps, deployment):
        return super().applies(backend, caps, deployment) or (
            None
            if hasattr(deployment.sender, "run_dir")
            else "the data plane is not files (only file-backed paths can hang in read())"
        )

    def on_unit(self, ctx, unit, data, where):
        if self.unit is not None or not where or not os.path.isfile(where):
            return
        self.unit = unit
        os.unlink(where)
        os.mkfifo(where)  # opened for reading, it blocks until a writer comes: none will
        self._fifo = where
        ctx.note(f"shard {where} replaced by a FIFO")
        return

    def heal(self, ctx):
        fifo = getattr(self, "_fifo", None)
        if fifo and os.path.exists(fifo):
            os.unlink(fifo)


class CommitFail(Fault):
    """One engine's commit fails at finish (out of memory), after the others may have committed."""

    kind = "commit-fail"
    control_plane = True

    def applies(self, backend, caps, deployment):
        if not deployment.processes():
            return "needs engines in rank processes (the trigger is per process)"
        if getattr(deployment, "own_engine", None):
            return f"the trigger is read by the fault engine's wrapper, which this backend does not run: {deployment.own_engine}"
        if len(deployment.handles) < 2:
            return "needs two engines"
        return None

    def points(self, caps):
        return ("last-engine", "first-engine")

    def arm(self, ctx, tensors):
        # the last engine to finish fails, so the others have committed: the divergence case; the
        # first: nothing committed anywhere
        last = {"last-engine": True, "first-engine": False}.get(ctx.point or "", ctx.rng.random() < 0.75)
        ctx.victim = len(ctx.deployment.handles) - 1 if last else 0
        self.trigger = (
            Path(os.environ[COMMIT_FAIL_DIR_ENV])
            / f"commit-fail-{ctx.deployment.processes()[ctx.victim].pid}"
        )
        self.trigger.write_text("armed")
        ctx.note(f"commit of receiver {ctx.victim} armed to fail")
        return tensors

    def disarm(self, ctx):
        self.trigger.unlink(missing_ok=True)

    def describe(self, ctx):
        return f"commit-fail receiver {ctx.victim}"


PRIVATE_SHM_ENV = "WEIGHTSYNC_PRIVATE_SHM"  # set where /dev/shm is a private tmpfs (harness.faults.cell)


class StorageFull(Fault):
    """The storage under the data plane fills up between two syncs (the push after it runs out of space,
    the one after heal has it back): for files, a small tmpfs under the checkpoint directory (ENOSPC
    mid-write, grown back at heal); for shared memory,
    /dev/shm filled to less than one version (only inside a private mount namespace, where /dev/shm
    is a tmpfs of the cell's own: the host's is never touched)."""

    kind = "storage-full"
    family = "between-syncs"

    @property
    def must_name(self) -> tuple[str, ...]:  # which filesystem ran out
        return ("/dev/shm",) if getattr(self, "filler", None) else (str(getattr(self, "mount", "")),)

    def applies(self, backend, caps, deployment):
        if os.geteuid() != 0:
            return "mounting a small tmpfs needs root"
        if caps.ipc:
            if os.environ.get(PRIVATE_SHM_ENV) != "1":
                return "/dev/shm may only be filled inside a private mount namespace (run_cell arranges it)"
            return None
        if not hasattr(deployment.sender, "run_dir"):
            return "the data plane writes no files this fault can reach (no sender.run_dir)"
        return None

    def setup(self, ctx):
        if os.environ.get(PRIVATE_SHM_ENV) == "1":
            free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
            # another job's file, not a segment of the trainer's: it must be there, intact, at heal
            self.filler = f"/dev/shm/other-job-{os.getpid()}-filler"
            fd = os.open(self.filler, os.O_CREAT | os.O_WRONLY, 0o600)
            try:
                os.posix_fallocate(fd, 0, max(free - (1 << 20), 1))  # leave 1 MiB: less than a version
            finally:
                os.close(fd)
            self.foreign = ForeignFile.of(self.filler)
            ctx.note(f"/dev/shm (private tmpfs) filled to 1 MiB free by {self.filler}")
            return
        self.mount = ctx.deployment.sender.run_dir  # the directory the next versions are written in
        used = sum(f.stat().st_size for f in self.mount.rglob("*") if f.is_file())
        self.size = max(used // 2, 64 << 10)  # too small for one more version
        _run(["mount", "-t", "tmpfs", "-o", f"size={self.size}", "tmpfs", str(self.mount)])
        ctx.note(f"{self.mount} is now a {self.size}-byte tmpfs")

    def arm(self, ctx, tensors):
        return tensors

    def heal(self, ctx):
        if getattr(self, "filler", None):
            self.foreign_problems = self.foreign.problems("after the faulty push")
            if os.path.exists(self.filler) and os.stat(self.filler).st_ino == self.foreign.ino:
                os.unlink(self.filler)
            self.filler = None
        elif getattr(self, "size", None):
            _run(["mount", "-o", f"remount,size={self.size * 16}", str(self.mount)])

    def check(self, ctx):
        return getattr(self, "foreign_problems", [])

    def teardown(self, ctx):
        if getattr(self, "filler", None):
            os.unlink(self.filler)
        if getattr(self, "size", None):
            _run(["umount", "-l", str(self.mount)])


class _WireFault(Fault):
    """A real TCP relay (harness.faults.relay) put between the trainer's HTTP client and one engine's
    control server for one push; it strikes one lifecycle request. The client must ride it out: retry
    with the same Idempotency-Key, the server replays or runs it once, the push succeeds."""

    must_succeed = True
    mode: str
    routes = (b"/start_weight_update", b"/update_weights", b"/finish_weight_update")

    def applies_to(self, caps):
        return (
            None
            if caps.http_control
            else "the backend does not claim 'http_control' (no HTTP lifecycle to cut)"
        )

    def applies(self, backend, caps, deployment):
        from harness.control.client import ControlClient

        if not all(
            isinstance(getattr(h.receiver, "client", None), ControlClient) for h in deployment.handles
        ):
            return (
                "no HTTP control plane between trainer and engines (receivers are not ControlClient-driven)"
            )
        return None

    def points(self, caps):
        return tuple(r.decode().lstrip("/") for r in self.routes)

    def arm(self, ctx, tensors):
        from urllib.parse import urlsplit

        from harness.faults.relay import TcpRelay

        ctx.victim = ctx.rng.randrange(len(ctx.deployment.handles))
        named = [r for r in self.routes if r.decode().lstrip("/") == ctx.point]
        self.route = named[0] if named else ctx.rng.choice(self.routes)
        fraction = round(ctx.rng.random(), 3)
        self.client = ctx.deployment.handles[ctx.victim].receiver.client
        self.replays_before = self.client.stats().get("idempotent_replays", 0)
        self.direct = self.client.base_url
        u = urlsplit(self.direct)
        self.relay = TcpRelay((u.hostname, u.port)).start()
        self.relay.arm(self.route, self.mode, fraction)
        self.client.reroute(self.relay.url)
        ctx.note(
            f"receiver {ctx.victim}: {self.direct} behind a relay, next POST {self.route.decode()}: {self.mode}"
        )
        return tensors

    def disarm(self, ctx):
        if getattr(self, "relay", None) is not None:
            self.client.reroute(self.direct)
            self.relay.close()

    def heal(self, ctx):
        if self.relay.fired is None:
            raise RuntimeError(f"the relay never saw POST {self.route.decode()}: nothing was struck")
        ctx.note(self.relay.fired)

    def check(self, ctx):
        try:
            replays = self.client.stats().get("idempotent_replays", 0) - self.replays_before
        except Exception as exc:  # noqa: BLE001 - the failed push is judged already
            return [f"the victim's /stats cannot be read after the fault: {type(exc).__name__}: {exc}"]
        expected = 1 if self.mode == "lose-answer" else 0  # a request never seen whole has nothing to replay
        if replays != expected:
            return [
                f"{self.mode} on POST {self.route.decode()}: the server replayed {replays} answer(s) from its "
                f"idempotency cache, expected {expected} (the retry {'ran it again' if replays < expected else 'was not needed'})"
            ]
        return []

    def describe(self, ctx):
        return f"{self.kind} receiver {ctx.victim} on POST {getattr(self, 'route', b'?').decode()}"


class HttpRequestCut(_WireFault):
    """The connection is cut (RST) part-way through a lifecycle request: the server never sees it whole."""

    kind = "http-request-cut"
    control_plane = True
    mode = "cut-request"


class HttpAnswerLost(_WireFault):
    """A lifecycle request runs on the server and its answer is lost (RST): the client cannot know it ran."""

    kind = "http-answer-lost"
    control_plane = True
    mode = "lose-answer"


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode:
        raise OSError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")

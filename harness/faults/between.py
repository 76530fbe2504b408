"""Damage between syncs: the machine removes, replaces, fills or kills something after a version was
committed, while nothing is in flight; the next push is judged (harness.checks.judge_cell).

What a cluster does to an idle deployment: systemd-logind's RemoveIPC unlinks a user's POSIX shared
memory when their last session ends; a retention cleaner deletes checkpoint directories, the newest
included; the OOM killer takes an engine's rank; another process takes a port a group would bind. The
first push after it commits bit for bit on every engine, or fails once with an error that names what
was damaged and the push after it commits: never "every push fails until someone redeploys".

Each kind does its damage in setup() (the cell calls it after the clean push committed) and strikes
nothing during the push; `must_name` are the words of which a failed push's error must carry one.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness.faults.injectors import Fault, FaultContext, PointNotApplicable
from harness.procs import pid_alive

FAMILY = "between-syncs"
POINT = "after-commit"  # the one point of this family: after a committed sync, nothing in flight


class BetweenSyncs(Fault):
    family = FAMILY

    def points(self, caps):
        return (POINT,)

    def setup(self, ctx: FaultContext) -> None:
        self.damage(ctx)

    def damage(self, ctx: FaultContext) -> None:
        raise NotImplementedError

    def arm(self, ctx, tensors):
        return tensors  # the damage is done; the push runs as the trainer would run it

    def describe(self, ctx):
        return f"{self.kind}: {getattr(self, 'what', 'nothing damaged')}"


def _cell_segments(ctx: FaultContext) -> list[str]:
    """The trainer's /dev/shm segments that this cell's deployment made (not a suite's other pools)."""
    from harness.paths.ipc import own_segments

    return sorted(set(own_segments()) - set(ctx.segments_before))


class ShmRemoved(BetweenSyncs):
    """Every shared-memory segment of the trainer unlinked from /dev/shm (logind's RemoveIPC=yes)."""

    kind = "shm-removed"

    def applies_to(self, caps):
        return None if caps.ipc else "the data plane is not shared memory (the backend does not claim 'ipc')"

    def damage(self, ctx):
        names = _cell_segments(ctx)
        if not names:
            raise PointNotApplicable(f"{self.kind}: the trainer holds no /dev/shm segment between syncs")
        for name in names:
            os.unlink(f"/dev/shm/{name}")
        self.names = names
        self.what = f"{len(names)} segment(s) of the trainer removed from /dev/shm"
        ctx.note(f"unlinked {names}")

    @property
    def must_name(self) -> tuple[str, ...]:
        return ("removed", *self.names)


class ShmReplaced(BetweenSyncs):
    """One segment of the trainer replaced by another process's file of the same name and size."""

    kind = "shm-replaced"

    def applies_to(self, caps):
        return None if caps.ipc else "the data plane is not shared memory (the backend does not claim 'ipc')"

    def damage(self, ctx):
        names = _cell_segments(ctx)
        if not names:
            raise PointNotApplicable(f"{self.kind}: the trainer holds no /dev/shm segment between syncs")
        name = names[ctx.rng.randrange(len(names))]
        path = Path("/dev/shm") / name
        size = path.stat().st_size
        path.unlink()
        # written by a child: the file is another process's, as it would be on a real host
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import os,sys; open(sys.argv[1],'wb').write(os.urandom(int(sys.argv[2])))",
                str(path),
                str(size),
            ],
            check=True,
            timeout=60,
        )
        self.path, self.ino = path, path.stat().st_ino
        self.what = f"segment {name} replaced by a foreign file of {size} bytes"
        ctx.note(self.what)

    @property
    def must_name(self) -> tuple[str, ...]:
        return ("replaced", "foreign", self.path.name)

    def teardown(self, ctx):
        path = getattr(self, "path", None)  # the foreign file is the host's, not the trainer's: removed here
        if path is not None and path.exists() and path.stat().st_ino == self.ino:
            path.unlink()


class CheckpointsRemoved(BetweenSyncs):
    """A retention cleaner deletes the published version directories, the newest included; the engines
    keep serving what they loaded."""

    kind = "checkpoints-removed"

    def applies(self, backend, caps, deployment):
        if not hasattr(deployment.sender, "run_dir"):
            return "the data plane writes no checkpoint directories (no sender.run_dir)"
        return None

    def damage(self, ctx):
        root = Path(ctx.deployment.sender.run_dir)
        published = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
        if not published:
            raise PointNotApplicable(f"{self.kind}: nothing published under {root}")
        for d in published:
            shutil.rmtree(d)
        self.names = [d.name for d in published]
        self.what = f"{len(published)} published version directories removed from {root}, the newest ({published[-1].name}) included"
        ctx.note(self.what)

    @property
    def must_name(self) -> tuple[str, ...]:
        return ("removed", "missing", *self.names)


def _kill(ctx: FaultContext, victim: int) -> int:
    """SIGKILL receiver `victim`'s rank and wait until it is gone (it is a child of this process)."""
    pid = ctx.deployment.processes()[victim].pid
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)  # the kernel's reaping, not the system under test: nothing else to wait on
    ctx.note(f"SIGKILL pid {pid} (receiver {victim}), idle")
    return pid


class RankKilledIdle(BetweenSyncs):
    """A receiver rank SIGKILLed while nothing syncs (the OOM killer, a node's reboot)."""

    kind = "rank-killed-idle"
    names_victim = True

    def applies(self, backend, caps, deployment):
        if not deployment.processes():
            return "the backend exposes no rank processes (Deployment.processes() is empty)"
        return None

    def damage(self, ctx):
        ctx.victim = len(ctx.deployment.handles) - 1
        pid = _kill(ctx, ctx.victim)
        self.what = f"receiver {ctx.victim}'s rank (pid {pid}) killed"

    must_name = ()  # names_victim: a failed push names the rank


def _group_port(sender) -> int | None:
    """The port the sender's group store listens on, through wrappers (delta over broadcast)."""
    for _ in range(4):
        port = getattr(sender, "store_port", None)
        if port is not None:
            return int(port)
        sender = getattr(sender, "transport", None)
        if sender is None:
            return None
    return None


#: A process that takes a TCP port the moment it is free and holds it until killed.
_SQUATTER = """
import socket, sys, time
port = int(sys.argv[1])
while True:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", port))
        s.listen(1)
        print("bound", flush=True)
        break
    except OSError:
        s.close()
        time.sleep(0.0005)
while True:
    time.sleep(3600)
"""


class PortTaken(BetweenSyncs):
    """A receiver lost while idle, so the group must be formed again; meanwhile another process takes
    the group's port the moment the trainer lets go of it (a job that binds it, an ephemeral port
    handed out). A sender that closes its store and binds the same port again finds it taken."""

    kind = "port-taken"
    names_victim = True

    def applies(self, backend, caps, deployment):
        if not deployment.processes():
            return "the backend exposes no rank processes (Deployment.processes() is empty)"
        if _group_port(deployment.sender) is None:
            return "the data plane has no group port (the sender has no store_port: not a collective)"
        return None

    def damage(self, ctx):
        self.port = _group_port(ctx.deployment.sender)
        self.squatter = subprocess.Popen(
            [sys.executable, "-c", _SQUATTER, str(self.port)], stdout=subprocess.PIPE, text=True
        )
        ctx.victim = len(ctx.deployment.handles) - 1
        pid = _kill(ctx, ctx.victim)
        self.what = f"receiver {ctx.victim} (pid {pid}) killed; port {self.port} taken by pid {self.squatter.pid} once free"
        ctx.note(self.what)

    @property
    def must_name(self) -> tuple[str, ...]:
        return (str(self.port), "in use")

    def heal(self, ctx):
        taken = self._stop()
        ctx.note(
            f"port {self.port} {'was taken by the squatter' if taken else 'never came free during the push'}"
        )

    def teardown(self, ctx):
        self._stop()

    def _stop(self) -> bool:
        squatter = getattr(self, "squatter", None)
        if squatter is None:
            return False
        squatter.kill()
        out, _ = squatter.communicate(timeout=10)
        self.squatter = None
        return "bound" in (out or "")


KINDS: tuple[type[Fault], ...] = (ShmRemoved, ShmReplaced, CheckpointsRemoved, RankKilledIdle, PortTaken)

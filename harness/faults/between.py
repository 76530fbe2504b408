"""Damage between syncs: the machine removes, replaces, fills or kills something after a version was
committed, while nothing is in flight; the next push is judged (harness.checks.judge_cell).

What a cluster does to an idle deployment: systemd-logind's RemoveIPC unlinks a user's POSIX shared
memory when their last session ends; a retention cleaner deletes checkpoint directories, the newest
included; the OOM killer takes an engine's rank; another process takes a port a group would bind. The
first push after it commits bit for bit on every engine, or fails once with an error that names what
was damaged and the push after it commits: never "every push fails until someone redeploys".

Each kind does its damage in setup() (the cell calls it after the clean push committed) and strikes
nothing during the push; `must_name` names the damaged thing (a segment, a directory, a port), of
which a failed push's error must carry one: never a phrase a writer prints on every failure
(harness.checks.STOCK_PHRASES). What the damage leaves there that is another process's (the file that
took a segment's name, the squatter on a port) must be there afterwards as it was, byte for byte.
"""

from __future__ import annotations

import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from harness.faults.injectors import Fault, FaultContext, ForeignFile, PointNotApplicable
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


class _ShmDamage(BetweenSyncs):
    """Damage to the trainer's shared-memory segments: applies to a path that claims 'ipc', at a point
    where the trainer holds a segment."""

    def applies_to(self, caps):
        return None if caps.ipc else "the data plane is not shared memory (the backend does not claim 'ipc')"

    def _segments(self, ctx: FaultContext) -> list[str]:
        names = _cell_segments(ctx)
        if not names:
            raise PointNotApplicable(f"{self.kind}: the trainer holds no /dev/shm segment between syncs")
        return names


class ShmRemoved(_ShmDamage):
    """Every shared-memory segment of the trainer unlinked from /dev/shm (logind's RemoveIPC=yes)."""

    kind = "shm-removed"

    def damage(self, ctx):
        names = self._segments(ctx)
        for name in names:
            os.unlink(f"/dev/shm/{name}")
        self.names = names
        self.what = f"{len(names)} segment(s) of the trainer removed from /dev/shm"
        ctx.note(f"unlinked {names}")

    @property
    def must_name(self) -> tuple[str, ...]:
        return tuple(self.names)


class ShmReplaced(_ShmDamage):
    """One segment of the trainer replaced by another process's file of the same name and size. The
    file is not the trainer's: after the faulty push and after the recovery it is still there, the
    same inode with the same bytes (a sender that takes the name back deletes someone's data)."""

    kind = "shm-replaced"

    def damage(self, ctx):
        names = self._segments(ctx)
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
        self.foreign = ForeignFile.of(path)
        self.what = f"segment {name} replaced by a foreign file of {size} bytes"
        ctx.note(self.what)

    @property
    def must_name(self) -> tuple[str, ...]:
        return (self.path.name,)

    def check(self, ctx):
        self.problems = self.foreign.problems("after the faulty push")
        return self.problems

    def check_after_recovery(self, ctx):
        done = getattr(self, "problems", [])
        return [] if done else self.foreign.problems("after the recovery push")

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
    def must_name(self) -> tuple[str, ...]:  # the directories themselves, not the run directory above
        return tuple(self.names)


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
    control_plane = True
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


#: A process that takes a TCP port the moment it is free and holds it until killed, answering every
#: connection with its nonce (so a check can tell it still holds the port).
_SQUATTER = """
import socket, sys, time
port, nonce = int(sys.argv[1]), sys.argv[2].encode()
while True:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", port))
        s.listen(8)
        print("bound", flush=True)
        break
    except OSError:
        s.close()
        time.sleep(0.0005)
while True:
    conn, _ = s.accept()
    conn.sendall(nonce + b"\\n")
    conn.close()
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
        self.nonce, self.bound = secrets.token_hex(8), False
        self.squatter = subprocess.Popen(
            [sys.executable, "-c", _SQUATTER, str(self.port), self.nonce], stdout=subprocess.PIPE, text=True
        )
        ctx.victim = len(ctx.deployment.handles) - 1
        pid = _kill(ctx, ctx.victim)
        self.what = f"receiver {ctx.victim} (pid {pid}) killed; port {self.port} taken by pid {self.squatter.pid} once free"
        ctx.note(self.what)

    @property
    def must_name(self) -> tuple[str, ...]:
        return (str(self.port),)

    def heal(self, ctx):
        self.problems = self._squatter_problems()
        taken = self._stop()
        ctx.note(
            f"port {self.port} {'was taken by the squatter' if taken else 'never came free during the push'}"
        )

    def check(self, ctx):
        return getattr(self, "problems", [])

    def teardown(self, ctx):
        self._stop()

    def _squatter_problems(self) -> list[str]:
        """The squatter is another process's: after the push it is alive and, where it took the port,
        the port still leads to it."""
        squatter = self.squatter
        if squatter.poll() is not None:
            return [
                f"after the faulty push: the process that took port {self.port} (pid {squatter.pid}, not the "
                f"trainer's) is gone (exit {squatter.returncode}): the trainer killed another process"
            ]
        if not self._bound():
            return []
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2.0) as conn:
                conn.settimeout(2.0)
                answer = conn.recv(64).decode(errors="replace").strip()
        except OSError as exc:
            answer = f"{type(exc).__name__}: {exc}"
        if answer != self.nonce:
            return [
                f"after the faulty push: port {self.port}, taken by pid {squatter.pid} (not the trainer's), "
                f"no longer leads to it (a connection got {answer[:80]!r}): the trainer took the port back"
            ]
        return []

    def _bound(self) -> bool:
        """Whether the squatter has taken the port yet (its one line, read without blocking)."""
        if not self.bound and select.select([self.squatter.stdout], [], [], 0)[0]:
            self.bound = "bound" in (self.squatter.stdout.readline() or "")
        return self.bound

    def _stop(self) -> bool:
        squatter = getattr(self, "squatter", None)
        if squatter is None:
            return False
        bound = self._bound()
        squatter.kill()
        out, _ = squatter.communicate(timeout=10)
        self.squatter = None
        return bound or "bound" in (out or "")


KINDS: tuple[type[Fault], ...] = (ShmRemoved, ShmReplaced, CheckpointsRemoved, RankKilledIdle, PortTaken)

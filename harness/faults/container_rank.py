"""Receiver ranks as containers: the same rank code (harness.launch.rank_server.rank_main), another host.

Rank side (inside the container):

    python -m harness.faults.container_rank --connect HOST:PORT --rank N --receiver PKG.MOD:CLS \
        [--engine NAME] [--spec-file FILE] --log FILE

connects back to the trainer with `multiprocessing.connection.Client` (the authkey comes in the
environment variable WEIGHTSYNC_RANK_AUTHKEY, hex; the channel carries raw send_bytes/recv_bytes
frames only, never pickles) and runs `rank_main` unchanged.

Trainer side: `ContainerRankProcess` is a `RankProcess` whose child is a container and whose pipe is
the connection a `multiprocessing.connection.Listener` accepted from it; `ContainerRankDeployment` is
a `RankDeployment` spawning those. The control channel crosses the same bridge network as the data,
so a network fault cuts both, as it would between real hosts.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import secrets
import select
import signal
import sys
import time
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Any

from harness import wire
from harness.api import DeployRequest, TransferError, WeightSpec
from harness.launch import RankDeployment
from harness.launch.supervision import DEFAULT_RPC_TIMEOUT, RPC_SLACK, START_TIMEOUT, FifoLock, RankProcess

AUTHKEY_ENV = "WEIGHTSYNC_RANK_AUTHKEY"


# ============================================================================ rank side
def main(argv: list[str] | None = None) -> None:
    from harness.launch.rank_server import rank_main

    p = argparse.ArgumentParser(prog="python -m harness.faults.container_rank")
    p.add_argument("--connect", required=True, help="HOST:PORT of the trainer's listener")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--receiver", required=True, help="pkg.module:Class of the receiver")
    p.add_argument("--engine", default=None)
    p.add_argument("--spec-file", default=None, help="JSON weight spec (harness.wire.spec_to_json)")
    p.add_argument("--log", required=True)
    a = p.parse_args(argv)
    key = os.environ.get(AUTHKEY_ENV)
    if not key:
        sys.exit(f"{AUTHKEY_ENV} is not set")
    host, _, port = a.connect.rpartition(":")
    spec_json = json.loads(Path(a.spec_file).read_text()) if a.spec_file else None
    conn = Client((host, int(port)), authkey=bytes.fromhex(key))
    rank_main(conn, a.rank, a.receiver, a.engine or None, spec_json, a.log)


# ============================================================================ trainer side
class ContainerProcess:
    """The process-like surface RankProcess uses (pid, is_alive, exitcode, join, kill) over a container.
    exitcode is the container's (137 for SIGKILL and OOM kills, where multiprocessing would say -9)."""

    def __init__(self, host, container):
        self.host, self.container = host, container
        self.name = container.name
        state = host.state(container)
        # docker-init's host pid, kept from the start: it forwards signals (SIGUSR1 for the stack dump)
        # to the rank. Never 0, which os.kill would take as our own process group.
        self.pid: int | None = int(state.get("Pid") or 0) or None

    def state(self) -> dict[str, Any]:
        return self.host.state(self.container)

    def is_alive(self) -> bool:
        return self.state().get("Status") in ("created", "running", "paused", "restarting")

    @property
    def exitcode(self) -> int | None:
        s = self.state()
        return (
            None if s.get("Status") in ("created", "running", "paused", "restarting") else s.get("ExitCode")
        )

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.is_alive():
            if deadline is not None and time.monotonic() > deadline:
                return
            time.sleep(0.05)

    def kill(self) -> None:
        try:
            self.container.kill()
        except Exception:  # noqa: BLE001, S110 - not running any more
            pass

    def describe(self) -> str:
        s = self.state()
        return (f"container {self.name}: {s.get('Status')}, exit code {s.get('ExitCode')}, "
                f"OOMKilled={s.get('OOMKilled')}")  # fmt: skip


class ContainerRankProcess(RankProcess):
    """A RankProcess whose child is a container on `host`'s network. Only the start differs: the
    container connects back to a Listener on the bridge gateway, and that connection is `_conn`."""

    def __init__(
        self,
        host,
        rank: int,
        receiver_path: str,
        engine: str | None,
        spec: WeightSpec | None,
        log_dir: Path,
        timeout: float = DEFAULT_RPC_TIMEOUT,
        container_options: dict[str, Any] | None = None,
        start_timeout: float = START_TIMEOUT,
    ):
        self.rank = rank
        self.timeout = timeout
        self.log_path = log_dir / f"rank{rank}.log"
        self.host = host
        self._lock = FifoLock()
        self._broken: str | None = None
        self._sent = collections.deque()  # calls begun, their replies not read yet (RankProcess.begin)
        authkey = secrets.token_bytes(32)
        listener = Listener((host.gateway_ip(), 0), authkey=authkey)
        try:
            port = listener.address[1]
            argv = ["python", "-m", "harness.faults.container_rank", "--connect", f"{host.gateway_ip()}:{port}",
                    "--rank", str(rank), "--receiver", receiver_path, "--log", str(self.log_path)]  # fmt: skip
            if engine:
                argv += ["--engine", engine]
            if spec is not None:
                spec_file = log_dir / f"rank{rank}.spec.json"
                spec_file.write_text(json.dumps(wire.spec_to_json(spec)))
                argv += ["--spec-file", str(spec_file)]
            container = host.run(
                f"rank{rank}-{secrets.token_hex(2)}", argv, env={AUTHKEY_ENV: authkey.hex()},
                mounts={str(log_dir.resolve()): "rw"}, **(container_options or {}),
            )  # fmt: skip
            self.container = container
            self.process = ContainerProcess(host, container)
            self._conn = self._accept(listener, start_timeout)
        finally:
            listener.close()
        with self._lock:
            self._reply("start", start_timeout)

    def _accept(self, listener: Listener, timeout: float):
        sock = listener._listener._socket
        deadline = time.monotonic() + timeout
        while True:
            ready, _, _ = select.select([sock], [], [], 0.1)
            if ready:
                try:
                    return listener.accept()  # the authkey challenge, both ways
                except Exception as exc:  # noqa: BLE001
                    self.process.kill()
                    raise TransferError(
                        f"rank {self.rank}: connection from its container refused: {exc}"
                    ) from None
            if not self.process.is_alive():
                raise TransferError(f"rank {self.rank} ({self.process.describe()}) exited before connecting; "
                                    f"log tail:\n{self.log_tail()}")  # fmt: skip
            if time.monotonic() > deadline:
                self.process.kill()
                raise TransferError(
                    f"rank {self.rank} did not connect within {timeout}s; log tail:\n{self.log_tail()}"
                )

    def log_tail(self, n: int = 20) -> str:
        tail = super().log_tail(n)
        process = getattr(self, "process", None)
        if process is None:
            return tail
        if tail == "(no log)" or not tail.strip():  # died before rank_main redirected its output
            tail = self.host.logs(self.container, n)
        return f"{tail}\n[{process.describe()}]"

    def stop(self, timeout: float = 10.0) -> None:
        conn = getattr(self, "_conn", None)
        try:
            if conn is not None:
                super().stop(timeout)
            else:
                self.process.kill()
        finally:
            self.host.remove(self.container)


class ContainerRankDeployment(RankDeployment):
    """RankDeployment whose receiver ranks are containers on `host` (a DockerHost): the base class
    starts (and after a failure restarts) every rank through `_spawn_rank`, which places it in a
    fresh container. `container_options` go to every rank's `containers.run` (e.g. mem_limit)."""

    def __init__(self, host, *args: Any, container_options: dict[str, Any] | None = None, **kwargs: Any):
        self.host = host
        self.container_options = dict(container_options or {})
        super().__init__(*args, **kwargs)

    def _prepare_spawn(self) -> None:
        """Nothing to boot: a container rank starts from its image, not from the warm fork server."""

    def _spawn_rank(self, rank: int, start_timeout: float = START_TIMEOUT) -> RankProcess:
        return ContainerRankProcess(
            self.host,
            rank,
            self._receiver_path,
            self._engine,
            self._spec,
            self._log_dir,
            self.timeout_s * RPC_SLACK,
            self.container_options,
            start_timeout,
        )


def deploy_broadcast(
    backend,
    host,
    n_receivers: int,
    spec: WeightSpec | None,
    workdir: str,
    engine: str | None = None,
    container_options: dict[str, Any] | None = None,
):
    """What BroadcastBackend.deploy builds, with the receiver ranks in containers on `host`: the sender
    hosts its store on the bridge gateway (the trainer's address as the containers see it). The trainer
    process needs host.trainer_env() in its environment (GLOO_SOCKET_IFNAME: gloo must listen on the bridge)."""
    return backend.build_with(
        ContainerRankDeployment,
        DeployRequest(n_receivers, spec, workdir, engine),
        {"addr": host.gateway_ip()},
        host=host,
        container_options=container_options,
    )


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    main()

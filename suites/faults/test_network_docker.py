"""Network faults between the trainer and receiver ranks running as separate hosts (containers on a
Docker bridge network). Nothing is simulated: links are cut, packets dropped, bandwidth capped and
processes OOM-killed by the kernel.

1. `test_nemesis_*`: each fault primitive, measured between two containers and the host (TCP echo,
   UDP counts, timed bulk transfers): it really cuts or degrades, and heal() restores it.
2. `test_broadcast_fault_cell`: the trainer on the host, 2 broadcast receivers in containers. Push v1,
   inject the fault while v2 is on the wire, heal, push v3. The verdict, as Jepsen gives it:
   safety (every engine serves exactly one committed version, bit for bit), bounded (the v2 push
   returns within 2x the backend timeout), recovery (v3 succeeds and every engine holds it).

Runs only with WEIGHTSYNC_DOCKER=1 (`.ci/docker-tier.sh`); without an engine it skips, "unknown: <why>".
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch

from harness.api import TensorSpec, WeightSyncError
from harness.backends.broadcast import BroadcastBackend
from harness.checks import CellObservation, judge_cell
from harness.deployment import push
from harness.faults.cell import cell_versions, detached, read_engines, recover
from harness.faults.container_rank import deploy_broadcast
from harness.faults.docker_net import (
    BandwidthCap,
    Disconnect,
    DockerHost,
    OneWayPartition,
    OomKill,
    PacketLoss,
    Partition,
)
from harness.pytest_plugin import docker_host_fixture

pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(
        os.environ.get("WEIGHTSYNC_DOCKER") != "1",
        reason="docker tier only: WEIGHTSYNC_DOCKER=1 (.ci/docker-tier.sh)",
    ),
]

TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def docker_host():
    yield from docker_host_fixture(DockerHost())


# ============================================================================ 1. the primitives, measured
SERVER = r"""
import socket, threading
count = [0]
def udp():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", 7001))
    while True:
        s.recv(2048); count[0] += 1
def serve(c):
    with c:
        first = c.recv(16)
        if first.startswith(b"ping"): c.sendall(b"pong")
        elif first.startswith(b"count"): c.sendall(str(count[0]).encode())
        elif first.startswith(b"reset"): count[0] = 0; c.sendall(b"ok")
def tcp():
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 7000)); s.listen(64)
    while True:
        c, _ = s.accept(); threading.Thread(target=serve, args=(c,), daemon=True).start()
def sink_one(c):
    with c:
        n = 0
        while True:
            b = c.recv(1 << 16)
            if not b: break
            n += len(b)
        c.sendall(str(n).encode())
def sink():
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 7002)); s.listen(8)
    while True:
        c, _ = s.accept(); threading.Thread(target=sink_one, args=(c,), daemon=True).start()
threading.Thread(target=udp, daemon=True).start(); threading.Thread(target=sink, daemon=True).start()
print("serving", flush=True); tcp()
"""

PROBE = r"""
import socket, sys, time
mode, host = sys.argv[1], sys.argv[2]
if mode == "tcp":
    n, ok = int(sys.argv[3]), 0
    for _ in range(n):
        try:
            c = socket.create_connection((host, 7000), timeout=0.5); c.sendall(b"ping")
            ok += c.recv(4) == b"pong"; c.close()
        except OSError:
            pass
    print(ok)
elif mode == "udp":
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _ in range(int(sys.argv[3])):
        s.sendto(b"x" * 512, (host, 7001)); time.sleep(0.002)
    print("sent")
elif mode == "bulk":
    data = b"\0" * int(sys.argv[3]); t0 = time.monotonic()
    c = socket.create_connection((host, 7002), timeout=60); c.sendall(data); c.shutdown(socket.SHUT_WR)
    got = int(c.recv(32)); print(got, time.monotonic() - t0)
"""


def _exec(host, container, *args) -> str:
    r = host.exec(container, ["python", "-c", PROBE, *map(str, args)])
    out = r.output.decode().strip().splitlines()
    assert r.exit_code == 0, f"probe in {container.name} exited {r.exit_code}: {r.output.decode()[-500:]}"
    return out[-1]


def tcp_ok(host, src, dst_ip: str, n: int = 10) -> int:
    """How many of n TCP request/replies from container src to dst_ip:7000 succeeded (0.5 s each)."""
    return int(_exec(host, src, "tcp", dst_ip, n))


def _ask(ip: str, what: bytes) -> str:
    """A question to a container's server, from the host (over the bridge, not through any fault)."""
    with socket.create_connection((ip, 7000), timeout=5) as c:
        c.sendall(what)
        return c.recv(32).decode()


def udp_delivered(host, src, dst, dst_ip: str, n: int) -> int:
    """Send n UDP datagrams from src to dst; how many dst counted."""
    _ask(dst_ip, b"reset")
    _exec(host, src, "udp", dst_ip, n)
    time.sleep(0.3)
    return int(_ask(dst_ip, b"count"))


def bulk_from_host(ip: str, nbytes: int) -> float:
    """Seconds to push nbytes from the host into the container's sink (acknowledged by its count)."""
    t0 = time.monotonic()
    with socket.create_connection((ip, 7002), timeout=120) as c:
        c.sendall(b"\0" * nbytes)
        c.shutdown(socket.SHUT_WR)
        got = int(c.recv(32))
    assert got == nbytes, (got, nbytes)
    return time.monotonic() - t0


def eventually(fn, want, within: float = 8.0):
    """fn() until it returns want (links take a moment to come back after a heal); the last value."""
    deadline = time.monotonic() + within
    while True:
        got = fn()
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.3)


@pytest.fixture(scope="module")
def pair(docker_host):
    """Two containers running SERVER; the host runs one too, on the bridge gateway."""
    a = docker_host.run("a", ["python", "-u", "-c", SERVER])
    b = docker_host.run("b", ["python", "-u", "-c", SERVER])
    deadline = time.monotonic() + 30
    while not all("serving" in docker_host.logs(c) for c in (a, b)):
        assert time.monotonic() < deadline, (
            f"servers did not start: {docker_host.logs(a)} {docker_host.logs(b)}"
        )
        time.sleep(0.2)
    return a, b, docker_host.ip_of(a), docker_host.ip_of(b)


@pytest.fixture(scope="module")
def host_echo(docker_host):
    """A TCP echo server on this host at the bridge gateway (the trainer's side)."""
    srv = socket.create_server((docker_host.gateway_ip(), 0))
    srv.settimeout(0.5)
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except TimeoutError:
                continue
            with c:
                if c.recv(4) == b"ping":
                    c.sendall(b"pong")

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join(2)
    srv.close()


def test_nemesis_disconnect(docker_host, pair):
    a, b, ip_a, ip_b = pair
    assert tcp_ok(docker_host, a, ip_b) == 10, "baseline a->b"
    fault = Disconnect(docker_host, b)
    fault.inject()
    try:
        assert tcp_ok(docker_host, a, ip_b, 4) == 0, "a still reaches b after b was disconnected"
    finally:
        fault.heal()
    assert docker_host.ip_of(b) == ip_b, "b came back with another address"
    assert eventually(lambda: tcp_ok(docker_host, a, ip_b), 10) == 10, "a->b not restored by heal()"
    assert eventually(lambda: tcp_ok(docker_host, b, ip_a), 10) == 10, "b->a not restored by heal()"


def test_nemesis_partition(docker_host, pair):
    a, b, ip_a, ip_b = pair
    fault = Partition(docker_host, a, ip_b)
    fault.inject()
    try:
        assert tcp_ok(docker_host, a, ip_b, 4) == 0, "a still reaches b"
        assert tcp_ok(docker_host, b, ip_a, 4) == 0, "b still reaches a"
        assert _ask(ip_a, b"ping") == "pong" and _ask(ip_b, b"ping") == "pong", "the host lost a or b"
    finally:
        fault.heal()  # raises if the rules after heal differ from before
    assert tcp_ok(docker_host, a, ip_b) == 10 and tcp_ok(docker_host, b, ip_a) == 10, (
        "heal() did not restore a<->b"
    )


def test_nemesis_partition_keeps_the_host_reachable(docker_host, pair, host_echo):
    a, _, _, ip_b = pair
    probe = (
        f"import socket\nc=socket.create_connection(('{docker_host.gateway_ip()}',{host_echo}),timeout=2)\n"
        "c.sendall(b'ping');print(c.recv(4).decode())"
    )
    with Partition(docker_host, a, ip_b):
        r = docker_host.exec(a, ["python", "-c", probe])
        assert r.output.decode().strip() == "pong", f"a lost the host during a partition from b: {r.output!r}"
    with Partition(docker_host, a, docker_host.gateway_ip()):  # the cell's fault: a cannot reach the trainer
        r = docker_host.exec(a, ["python", "-c", probe])
        assert r.exit_code != 0, f"a reached the host through a partition: {r.output!r}"
        assert tcp_ok(docker_host, a, ip_b, 4) == 4, "a lost b while only the host was cut off"
    r = docker_host.exec(a, ["python", "-c", probe])
    assert r.output.decode().strip() == "pong", f"heal() did not restore a->host: {r.output!r}"


def test_nemesis_one_way_partition(docker_host, pair):
    a, b, ip_a, ip_b = pair
    with OneWayPartition(docker_host, a, ip_b):  # a hears nothing from b
        b_to_a = udp_delivered(docker_host, b, a, ip_a, 50)
        a_to_b = udp_delivered(docker_host, a, b, ip_b, 50)
    assert b_to_a == 0, f"{b_to_a}/50 datagrams b->a arrived through the one-way partition"
    assert a_to_b == 50, f"only {a_to_b}/50 datagrams a->b arrived: the partition is not one-way"
    assert udp_delivered(docker_host, b, a, ip_a, 50) == 50, "heal() did not restore b->a"


def test_nemesis_packet_loss(docker_host, pair):
    a, b, ip_a, _ = pair
    n = 400
    with PacketLoss(docker_host, a, 0.2):
        got = udp_delivered(docker_host, b, a, ip_a, n)
    ratio = got / n
    # binomial(400, 0.8): sd 0.02; the window is 5 sd each side
    assert 0.70 <= ratio <= 0.90, f"{got}/{n} delivered ({ratio:.0%}) with 20% loss configured"
    healed = udp_delivered(docker_host, b, a, ip_a, n)
    assert healed == n, f"{healed}/{n} delivered after heal()"


def test_nemesis_bandwidth_cap(docker_host, pair):
    a, _, ip_a, ip_b = pair
    nbytes = 2 << 20
    before = bulk_from_host(ip_a, nbytes)
    with BandwidthCap(docker_host, a, "4mbit"):  # 0.5 MB/s
        capped_in = bulk_from_host(ip_a, nbytes)
        _, capped_out = _exec(docker_host, a, "bulk", ip_b, 1 << 20).split()
    after = bulk_from_host(ip_a, nbytes)
    rate_in, rate_out = nbytes / capped_in / 1e6, (1 << 20) / float(capped_out) / 1e6
    print(f"bandwidth host->a: {nbytes / before / 1e6:.0f} MB/s, capped {rate_in:.2f} MB/s, healed "
          f"{nbytes / after / 1e6:.0f} MB/s; a->b capped {rate_out:.2f} MB/s")  # fmt: skip
    assert 0.2 < rate_in < 0.75, f"host->a ran at {rate_in:.2f} MB/s under a 4mbit (0.5 MB/s) cap"
    assert 0.2 < rate_out < 0.75, f"a->b ran at {rate_out:.2f} MB/s under a 4mbit (0.5 MB/s) cap"
    assert nbytes / after / 1e6 > 5, f"after heal() host->a still at {nbytes / after / 1e6:.2f} MB/s"


def test_nemesis_oom_kill(docker_host):
    c = docker_host.run("oom", ["python", "-c", "import time\nwhile True: time.sleep(1)"],
                        mem_limit="256m", memswap_limit="256m")  # fmt: skip
    time.sleep(1.0)
    fault = OomKill(docker_host, c)
    fault.inject()
    state = fault.wait(30)
    fault.heal()
    assert state["ExitCode"] == 137 and state["OOMKilled"], f"container state after the allocation: {state}"


# ============================================================================ 2. broadcast under faults
# 8 tensors x 2 MiB: 8 buckets (one tensor each), so a fault lands with data on the wire
SPEC = {f"layers.{i}.weight": TensorSpec((512, 1024), torch.float32) for i in range(8)}


class _TriggerOnPack(dict):
    """The v2 payload: the first read of `key` after the trainer started transmitting (packing bucket 2
    of 8 while bucket 1 is on the wire) injects the fault from the sender's thread."""

    def __init__(self, data, key, action):
        super().__init__(data)
        self.key, self.action, self.armed, self.fired = key, action, False, None

    def __getitem__(self, name):
        if self.armed and self.fired is None and name == self.key:
            self.fired = time.monotonic()
            self.action()
        return super().__getitem__(name)


def _make_fault(kind, host, victim, other):
    gw = host.gateway_ip()
    if kind == "disconnect":
        return Disconnect(host, victim)
    if (
        kind == "partition"
    ):  # the victim cannot reach the trainer (both ways); it still reaches the other rank
        return Partition(host, victim, gw)
    if kind == "one_way":  # the victim hears nothing from the trainer; what it sends still arrives
        return OneWayPartition(host, victim, gw)
    if kind == "loss20":
        return PacketLoss(host, victim, 0.2)
    if kind == "bandwidth":
        return BandwidthCap(host, victim, "8mbit")  # 1 MB/s: 16 MiB take ~16 s, over the 5 s timeout
    if kind == "oom":
        return OomKill(host, victim)
    raise ValueError(kind)


CELLS = ["disconnect", "partition", "one_way", "loss20", "bandwidth", "oom"]


class NetworkFault:
    """What the checker needs to know of a network fault: its kind. The error need not name the victim
    rank: a cut link times out whichever rank waits on it first."""

    names_victim = False

    def __init__(self, kind: str):
        self.kind = kind


@pytest.mark.parametrize("kind", CELLS)
def test_broadcast_fault_cell(kind, docker_host, tmp_path, monkeypatch):
    for k, v in docker_host.trainer_env().items():  # gloo on the trainer listens on the bridge
        monkeypatch.setenv(k, v)
    backend = BroadcastBackend(timeout_s=TIMEOUT_S)
    options = {"mem_limit": "1500m", "memswap_limit": "1500m"} if kind == "oom" else {}
    with deploy_broadcast(backend, docker_host, 2, SPEC, str(tmp_path), container_options=options) as dep:
        sent = cell_versions(SPEC, seed=1)  # consecutive trainer steps, as every fault cell pushes
        push(dep, 1, sent[1])

        victim, other = dep.ranks[1], dep.ranks[0]  # rank 2 takes the fault
        fault = _make_fault(kind, docker_host, victim.container, other.container)
        payload = _TriggerOnPack(sent[2], "layers.2.weight", fault.inject)
        transmit = dep.sender.transmit

        def armed_transmit():
            payload.armed = True
            return transmit()

        dep.sender.transmit = armed_transmit
        obs = CellObservation(
            fault=NetworkFault(kind),
            timeout_s=TIMEOUT_S,
            versions=sent,
            version=2,
            recovery_version=3,
            victim_name=dep.processes()[1].name,
        )
        t0 = time.monotonic()
        try:
            push(dep, 2, payload)
        except WeightSyncError as exc:
            obs.error = detached(exc)
        obs.detect_s = time.monotonic() - t0
        dep.sender.transmit = transmit
        if payload.fired is None:
            fault.inject()  # never reached bucket 2: inject now so the cell still tests what it names
        if isinstance(fault, OomKill):
            state = fault.wait(30)
            assert state["OOMKilled"] and state["ExitCode"] == 137, f"the victim was not OOM-killed: {state}"
        fault.heal()
        obs.after_fault = read_engines(dep)
        recover(dep, obs, 3)
        verdict, reasons = judge_cell(obs)
        print(f"\n[{kind}] v2: {obs.error_text() or 'succeeded'} in {obs.detect_s:.1f}s (fault at "
              f"+{(payload.fired or t0) - t0:.2f}s); v3 after heal in {obs.recover_s:.1f}s, restarts "
              f"{getattr(dep, 'restarts', '?')}")  # fmt: skip
        assert verdict == "ok", f"[{kind}] network fault cell:\n  " + "\n  ".join(reasons)

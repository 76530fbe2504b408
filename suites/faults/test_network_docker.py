"""Network faults between the trainer and receiver ranks running as separate hosts (containers on a
Docker bridge network). Nothing is simulated: links are cut, packets dropped, bandwidth capped and
processes OOM-killed by the kernel.

1. `test_nemesis_*`: each fault primitive, measured between two containers and the host (TCP echo,
   UDP counts, timed bulk transfers): it really cuts or degrades, and heal() restores it.
2. `test_broadcast_fault_cell`: each network kind of the fault matrix (harness.faults.network: net-disconnect,
   net-partition, net-one-way, net-loss20, net-bandwidth, net-oom), its cell run as the matrix runs any kind:
   the trainer on the host, 2 broadcast receivers in containers. Push v1, inject the fault while v2 is on
   the wire, heal, push v3. The verdict, as Jepsen gives it: safety (every engine serves exactly one
   committed version, bit for bit), bounded (the v2 push returns within 2x the backend timeout), recovery
   (v3 succeeds and every engine holds it).

Runs only with WEIGHTSYNC_DOCKER=1 (`.ci/docker-tier.sh`); without an engine it skips, "unknown: <why>".
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from harness.backends.broadcast import BroadcastBackend
from harness.faults.docker_net import (
    BandwidthCap,
    Disconnect,
    DockerHost,
    OneWayPartition,
    OomKill,
    PacketLoss,
    Partition,
)
from harness.faults.kinds import NETWORK_KINDS
from harness.faults.matrix import run_matrix_cell
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
    # held, memory filled: the trigger of a mid-transfer cell costs the last chunks, not an exec
    assert fault.allocator_pid, "the held allocator did not start (inject() would exec one: seconds)"
    fault.inject()
    state = fault.wait(30)
    fault.heal()
    assert state["ExitCode"] == 137 and state["OOMKilled"], f"container state after the allocation: {state}"


# ============================================================================ 2. broadcast under faults
@pytest.mark.parametrize("kind", NETWORK_KINDS)
def test_broadcast_fault_cell(kind, docker_host, tmp_path):
    """The matrix's cell of each network kind (harness.faults.network_cell), run as the fault matrix runs
    any kind (harness.faults.matrix.run_matrix_cell), with the broadcast path's ranks in containers."""
    backend = BroadcastBackend(timeout_s=TIMEOUT_S)
    result = run_matrix_cell(
        backend,
        "broadcast",
        kind,
        0,
        tmp_path,
        None,
        TIMEOUT_S,
        backend.capabilities,
        docker_host=docker_host,
    )
    print(f"\n[{kind}] " + "; ".join(result.log))
    if result.verdict == "unknown":
        pytest.skip(f"unknown: {kind}: {'; '.join(result.reasons)}")
    assert result.verdict == "ok", f"[{kind}] network fault cell:\n  " + "\n  ".join(result.reasons)

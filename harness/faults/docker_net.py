"""The network nemesis over Docker: containers as hosts on a bridge network, and real faults between them.

`DockerHost` finds or starts a Docker engine, imports an almost empty image (no registry needed) and
creates a bridge network with a unique name; containers run the host's own Python and packages,
bind-mounted read-only. Every fault is an object with `inject()` and `heal()` (Jepsen's nemesis):

| fault | how |
| --- | --- |
| `Disconnect(host, c)` | `docker network disconnect`, healed by reconnecting with the same IP |
| `Partition(host, a, b_ip)` | iptables DROP both ways between a and b_ip, inside a's network namespace |
| `OneWayPartition(host, a, b_ip)` | iptables DROP of what a receives from b_ip (a's packets still reach b) |
| `PacketLoss(host, c, p)` | iptables `statistic --mode random` DROP with probability p, in and out |
| `BandwidthCap(host, c, rate)` | tc tbf on the container's interface and on its host-side veth (both directions) |
| `OomKill(host, c)` | the container (run with mem_limit) allocates past its limit; the kernel kills its main process |

Faults are never simulated: a test that cannot get an engine gets `DockerUnavailable(reason)` and
must skip with that reason. Everything created is named with a per-process unique prefix and only
what this object created is removed (containers, network, image, and the engine if it started one).
There is no delay fault: this kernel has no netem.

Why one file: every fault here stands on the same engine, image, network and namespace plumbing (`DockerHost`);
the faults are the table above, each a few lines over it.
"""

from __future__ import annotations

import io
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ENV_DOCKER_HOST = "WEIGHTSYNC_DOCKER_HOST"  # an existing engine's socket URL, e.g. unix:///run/docker.sock
REPO_ROOT = Path(__file__).resolve().parents[2]


class DockerUnavailable(RuntimeError):
    """No Docker engine could be found or started here; `reason` says why (tests skip with it)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _run(argv: list[str], check: bool = True, timeout: float = 30.0) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {r.returncode}: {(r.stdout + r.stderr).strip()}")
    return (r.stdout + r.stderr).strip()


def _mounts_under(path: Path) -> list[str]:
    """Mount points at or below `path` (a data root must never be deleted while one is mounted)."""
    root = str(path.resolve())
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].replace("\\040", " ")
            if mp == root or mp.startswith(root + "/"):
                out.append(mp)
    return out


# ============================================================================ the engine and its network
class DockerHost:
    """A Docker engine (found or started), one image, one bridge network, and the containers run on it."""

    def __init__(
        self,
        prefix: str | None = None,
        extra_mounts: dict[str, str] | None = None,
        start_timeout: float = 30.0,
    ):
        self.prefix = prefix or f"wsf{os.getpid()}{secrets.token_hex(2)}"
        self.extra_mounts = dict(extra_mounts or {})  # host path -> "ro" | "rw", mounted at the same path
        self.start_timeout = start_timeout
        self.client = None
        self.network = None
        self.image: str | None = None
        self.containers: list = []
        self.subnet: str | None = None
        self._gateway: str | None = None
        self._engine_dir: Path | None = None
        self._engine_pid: int | None = None
        self._engine_log: Path | None = None
        self.base_url: str | None = None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> DockerHost:  # noqa: PYI034
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self._connect_engine()
        self._build_image()
        self._create_network()

    def _connect_engine(self) -> None:
        try:
            import docker
        except ImportError as exc:
            raise DockerUnavailable(f"the docker Python SDK is not installed ({exc})") from None
        url = os.environ.get(ENV_DOCKER_HOST)
        if url:
            try:
                self.client = docker.DockerClient(base_url=url, timeout=60)
                self.client.ping()
            except Exception as exc:  # noqa: BLE001 - any failure to reach it is the reason
                raise DockerUnavailable(
                    f"{ENV_DOCKER_HOST}={url} does not answer: {type(exc).__name__}: {exc}"
                ) from None
            self.base_url = url
            return
        dockerd = shutil.which("dockerd")
        if dockerd is None:
            raise DockerUnavailable(f"no dockerd binary on PATH and {ENV_DOCKER_HOST} is not set")
        if os.geteuid() != 0:
            raise DockerUnavailable(
                f"starting dockerd needs root (euid {os.geteuid()}) and {ENV_DOCKER_HOST} is not set"
            )
        for tool in ("iptables", "nsenter", "tc"):
            if shutil.which(tool) is None:
                raise DockerUnavailable(f"the nemesis needs {tool!r}, not on PATH")
        d = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-", dir="/tmp"))  # short: a socket path has 108 bytes
        self._engine_dir = d
        self._engine_log = d / "dockerd.log"
        sock = d / "docker.sock"
        argv = [
            dockerd, "-H", f"unix://{sock}", "--data-root", str(d / "root"), "--exec-root", str(d / "exec"),
            "--pidfile", str(d / "dockerd.pid"), "--iptables=false", "--bridge=none", "--storage-driver=vfs",
        ]  # fmt: skip
        if shutil.which("docker-init") is None:  # Debian's docker.io ships tini without the docker-init name
            init = shutil.which("tini-static") or shutil.which("tini")
            if init is None:
                raise DockerUnavailable(
                    "no docker-init, tini-static or tini binary: containers could not take signals"
                )
            argv += ["--init-path", init]
        with open(self._engine_log, "wb") as log:
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self._engine_pid = proc.pid
        self._engine_proc = proc
        self.base_url = f"unix://{sock}"
        deadline = time.monotonic() + self.start_timeout
        last = None
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise DockerUnavailable(f"dockerd exited {proc.returncode}: {self._engine_log_tail()}")
            if sock.exists():
                try:
                    self.client = docker.DockerClient(base_url=self.base_url, timeout=60)
                    self.client.ping()
                    return
                except Exception as exc:  # noqa: BLE001 - not ready yet
                    last = exc
            time.sleep(0.2)
        raise DockerUnavailable(
            f"dockerd not ready within {self.start_timeout}s ({last}): {self._engine_log_tail()}"
        )

    def _engine_log_tail(self, n: int = 8) -> str:
        try:
            return " | ".join(self._engine_log.read_text(errors="replace").splitlines()[-n:])  # type: ignore[union-attr]
        except (OSError, AttributeError):
            return "(no log)"

    def _build_image(self) -> None:
        """An almost empty rootfs: the host's /usr and Python prefixes are bind-mounted at run time."""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:

            def add_dir(name: str, mode: int = 0o755) -> None:
                info = tarfile.TarInfo(name)
                info.type, info.mode = tarfile.DIRTYPE, mode
                tar.addfile(info)

            # sbin is a real folder: the engine mounts its init at /sbin/docker-init, which must not
            # resolve into the read-only /usr bind
            for name in ("usr", "etc", "proc", "sys", "dev", "root", "run", "var", "work", "opt", "sbin"):
                add_dir(name)
            add_dir("tmp", 0o1777)
            add_dir("var/tmp", 0o1777)
            for link, target in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64")):
                info = tarfile.TarInfo(link)
                info.type, info.linkname = tarfile.SYMTYPE, target
                tar.addfile(info)
            for f in ("/etc/passwd", "/etc/group", "/etc/nsswitch.conf"):
                if os.path.exists(f):
                    tar.add(f, arcname=f.lstrip("/"))
        name = f"{self.prefix}-img"
        self.client.api.import_image_from_data(
            buf.getvalue(), repository=name, tag="latest",
            changes=["ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
        )  # fmt: skip
        self.image = f"{name}:latest"

    def _create_network(self) -> None:
        import docker

        taken = _run(["ip", "-4", "route"], check=False)
        last = None
        for attempt in range(12):
            second = (os.getpid() + attempt * 37 + secrets.randbelow(200)) % 250 + 1
            subnet = f"10.213.{second}.0/24"
            if f"10.213.{second}." in taken:
                continue
            gateway = f"10.213.{second}.1"
            ipam = docker.types.IPAMConfig(
                pool_configs=[docker.types.IPAMPool(subnet=subnet, gateway=gateway)]
            )
            try:
                self.network = self.client.networks.create(f"{self.prefix}-net", driver="bridge", ipam=ipam)
            except docker.errors.APIError as exc:  # the pool overlaps another network's: try another
                last = exc
                continue
            self.subnet, self._gateway = subnet, gateway
            return
        raise DockerUnavailable(f"could not create a bridge network: {last}")

    def close(self) -> None:
        """Remove what this object created; stop the engine only if it started it."""
        errors = []
        for c in self.containers:
            try:
                c.remove(force=True)
            except Exception as exc:  # noqa: BLE001
                if "No such container" not in str(exc):
                    errors.append(f"container {c.name}: {exc}")
        self.containers = []
        if self.network is not None:
            try:
                self.network.remove()
            except Exception as exc:  # noqa: BLE001
                errors.append(f"network: {exc}")
            self.network = None
        if self.image is not None and self.client is not None:
            try:
                self.client.images.remove(self.image, force=True)
            except Exception as exc:  # noqa: BLE001
                errors.append(f"image: {exc}")
            self.image = None
        if self.client is not None:
            self.client.close()
            self.client = None
        if self._engine_pid is not None:
            self._stop_engine()
        if errors:
            print(f"DockerHost.close: {'; '.join(errors)}", file=sys.stderr)

    def _stop_engine(self) -> None:
        pid, proc = self._engine_pid, self._engine_proc
        try:
            os.kill(pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(pid, signal.SIGKILL)
                proc.wait(10)
        except ProcessLookupError:
            pass
        self._engine_pid = None
        d = self._engine_dir
        if d is not None and d.exists():
            mounted = _mounts_under(d)
            if mounted:  # never delete through a mount point
                print(f"DockerHost: left {d} in place, still mounted: {mounted[:3]}", file=sys.stderr)
            else:
                shutil.rmtree(d, ignore_errors=True)

    # ------------------------------------------------------------------ containers
    def python_mounts(self) -> dict[str, dict[str, str]]:
        """Read-only binds that let a container run this interpreter, its packages and the repo."""
        paths = {"/usr", os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), str(REPO_ROOT)}
        for p in sys.path:  # site-packages outside those (a venv's, a user site)
            rp = os.path.realpath(p) if p else ""
            if rp and os.path.isdir(rp) and not any(rp == q or rp.startswith(q + "/") for q in paths):
                paths.add(rp)
        vols = {p: {"bind": p, "mode": "ro"} for p in sorted(paths) if os.path.exists(p)}
        for p, mode in self.extra_mounts.items():
            vols[p] = {"bind": p, "mode": mode}
        return vols

    def run(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        mounts: dict[str, str] | None = None,
        **kwargs: Any,
    ):
        """Start a container on the network (init=True, so it takes signals) and return it.
        argv[0] == "python" runs this interpreter. `mounts`: host path -> "ro"|"rw", at the same path."""
        argv = [sys.executable if a == "python" and i == 0 else a for i, a in enumerate(argv)]
        vols = self.python_mounts()
        for p, mode in (mounts or {}).items():
            vols[p] = {"bind": p, "mode": mode}
        environment = {
            "PYTHONPATH": str(REPO_ROOT),
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
            "HOME": "/tmp",
            **(env or {}),
        }
        # no GLOO_SOCKET_IFNAME: gloo binds the address the container's hostname resolves to, which
        # survives a disconnect/reconnect (the interface comes back as eth1, the IP is kept)
        c = self.client.containers.run(
            self.image, argv, name=f"{self.prefix}-{name}", network=self.network.name, volumes=vols,
            environment=environment, working_dir=str(REPO_ROOT), init=True, detach=True,
            dns_opt=["timeout:1", "attempts:1"], **kwargs,
        )  # fmt: skip
        self.containers.append(c)
        return c

    def exec(self, container, argv: list[str], **kwargs: Any):
        """exec_run in a running container; argv[0] == "python" runs this interpreter. Returns ExecResult."""
        argv = [sys.executable if a == "python" and i == 0 else a for i, a in enumerate(argv)]
        return container.exec_run(argv, **kwargs)

    def remove(self, container) -> None:
        try:
            container.remove(force=True)
        except Exception:  # noqa: BLE001, S110 - already gone
            pass
        self.containers = [c for c in self.containers if c.id != container.id]

    def logs(self, container, tail: int = 40) -> str:
        try:
            return container.logs(tail=tail).decode(errors="replace")
        except Exception as exc:  # noqa: BLE001
            return f"(no logs: {exc})"

    def state(self, container) -> dict[str, Any]:
        try:
            container.reload()
            return container.attrs["State"]
        except Exception:  # noqa: BLE001 - removed
            return {"Status": "removed", "Running": False, "ExitCode": None, "OOMKilled": False, "Pid": 0}

    def ip_of(self, container) -> str:
        container.reload()
        net = container.attrs["NetworkSettings"]["Networks"].get(self.network.name)
        if not net or not net.get("IPAddress"):
            raise RuntimeError(f"container {container.name} has no address on {self.network.name}")
        return net["IPAddress"]

    def gateway_ip(self) -> str:
        """The bridge's host side: where containers reach processes running on this host."""
        return self._gateway  # type: ignore[return-value]

    def bridge_ifname(self) -> str:
        """The bridge interface on this host (for GLOO_SOCKET_IFNAME of a trainer on the host)."""
        name = f"br-{self.network.id[:12]}"
        if not os.path.exists(f"/sys/class/net/{name}"):
            out = _run(["ip", "-o", "-4", "addr", "show"], check=False)
            for line in out.splitlines():
                if f" {self._gateway}/" in line:
                    return line.split()[1]
        return name

    def trainer_env(self) -> dict[str, str]:
        """Environment for a trainer on this host whose ranks run in containers."""
        return {"WEIGHTSYNC_MASTER_ADDR": self.gateway_ip(), "GLOO_SOCKET_IFNAME": self.bridge_ifname()}

    def ifname_of(self, container) -> str:
        """The container's interface on this network (eth0 at first; eth1 after a reconnect)."""
        ip = self.ip_of(container)
        for line in self.nsenter(container, ["ip", "-o", "-4", "addr", "show"]).splitlines():
            if f" {ip}/" in line:
                return line.split()[1]
        raise RuntimeError(f"container {container.name}: no interface holds {ip}")

    def pid_of(self, container) -> int:
        pid = int(self.state(container).get("Pid") or 0)
        if pid <= 0:
            raise RuntimeError(f"container {container.name} is not running")
        return pid

    def nsenter(self, container, argv: list[str], check: bool = True) -> str:
        """Run a host binary (iptables, tc, ip) inside the container's network namespace."""
        return _run(["nsenter", "-t", str(self.pid_of(container)), "-n", *argv], check=check)


# ============================================================================ the nemesis
class NetworkPrimitive:
    """What a network fault does to the bridge (the nemesis's primitive; the fault kinds of the matrix,
    harness.faults.network, each make one): inject() then heal(); heal() is idempotent and restores the
    network exactly."""

    description = "network primitive"

    def __init__(self) -> None:
        self.active = False

    def inject(self) -> None:
        raise NotImplementedError

    def heal(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> NetworkPrimitive:  # noqa: PYI034
        self.inject()
        return self

    def __exit__(self, *exc: object) -> None:
        self.heal()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.description} {'active' if self.active else 'healed'}>"


class Disconnect(NetworkPrimitive):
    """The container loses its network link (docker network disconnect); heal reconnects it with the same IP."""

    def __init__(self, host: DockerHost, container):
        super().__init__()
        self.host, self.container = host, container
        self.ip = host.ip_of(container)
        self.description = f"{container.name} disconnected from {host.network.name}"

    def inject(self) -> None:
        self.host.network.disconnect(self.container, force=True)
        self.active = True

    def heal(self) -> None:
        if not self.active:
            return
        if (
            self.host.state(self.container).get("Status") != "removed"
        ):  # a removed container has no link to restore
            self.host.network.connect(self.container, ipv4_address=self.ip)
        self.active = False


class _IptablesFault(NetworkPrimitive):
    """Rules appended in the container's own network namespace; heal deletes exactly those rules."""

    def __init__(self, host: DockerHost, container, rules: list[list[str]]):
        super().__init__()
        self.host, self.container, self.rules = host, container, rules
        self.before: str | None = None

    def _rules_now(self) -> str:
        return "\n".join(
            line for line in self.host.nsenter(self.container, ["iptables-save", "-t", "filter"]).splitlines()
            if not line.startswith("#") and not line.startswith(":")  # counters and timestamps vary
        )  # fmt: skip

    def inject(self) -> None:
        self.before = self._rules_now()
        self.active = True  # from the first rule on, heal has something to undo
        for rule in self.rules:
            self.host.nsenter(self.container, ["iptables", "-I", *rule])

    def heal(self) -> None:
        if not self.active:
            return
        if self.host.state(self.container).get("Running"):
            for rule in self.rules:
                self.host.nsenter(self.container, ["iptables", "-D", *rule], check=False)
            after = self._rules_now()
            if after != self.before:
                raise RuntimeError(
                    f"{self.description}: rules after heal differ from before:\n{after}\nvs\n{self.before}"
                )
        # a container that is gone took its namespace (and the rules) with it
        self.active = False


class Partition(_IptablesFault):
    """a and b_ip cannot exchange a single packet (both directions dropped in a's namespace); both
    still reach everyone else."""

    def __init__(self, host: DockerHost, a, b_ip: str):
        super().__init__(host, a, [["INPUT", "-s", b_ip, "-j", "DROP"], ["OUTPUT", "-d", b_ip, "-j", "DROP"]])
        self.description = f"{a.name} -x- {b_ip}"


class OneWayPartition(_IptablesFault):
    """a receives nothing from b_ip, while what a sends still reaches b (for TCP this stalls
    connections in both directions, since b's acknowledgements are lost: a real asymmetric link)."""

    def __init__(self, host: DockerHost, a, b_ip: str):
        super().__init__(host, a, [["INPUT", "-s", b_ip, "-j", "DROP"]])
        self.description = f"{b_ip} -> {a.name} dropped"


class PacketLoss(_IptablesFault):
    """Each packet into and out of the container is dropped with probability p (independently)."""

    def __init__(self, host: DockerHost, container, p: float):
        if not 0.0 < p < 1.0:
            raise ValueError(f"loss probability must be in (0, 1), got {p}")
        stat = ["-m", "statistic", "--mode", "random", "--probability", f"{p}", "-j", "DROP"]
        super().__init__(host, container, [["INPUT", *stat], ["OUTPUT", *stat]])
        self.p = p
        self.description = f"{container.name} loses {p:.0%} of packets each way"


class BandwidthCap(NetworkPrimitive):
    """tc tbf at `rate` on the container's eth0 (what it sends) and on its host-side veth (what it
    receives); heal deletes both root qdiscs, restoring the defaults."""

    def __init__(
        self, host: DockerHost, container, rate: str = "8mbit", burst: str = "32kbit", latency: str = "400ms"
    ):
        super().__init__()
        self.host, self.container = host, container
        self.rate, self.burst, self.latency = rate, burst, latency
        self.description = f"{container.name} capped at {rate}"
        self._veth: str | None = None
        self._dev = "eth0"
        self._before: tuple[str, str] | None = None

    def _host_veth(self) -> str:
        self._dev = self.host.ifname_of(self.container)
        out = self.host.nsenter(self.container, ["ip", "-o", "link", "show", self._dev])
        m = re.search(rf"{self._dev}@if(\d+)", out)
        if not m:
            raise RuntimeError(f"cannot find eth0's peer: {out}")
        idx = m.group(1)
        for line in _run(["ip", "-o", "link", "show"]).splitlines():
            if line.split(":", 1)[0].strip() == idx:
                return line.split(":")[1].strip().split("@")[0]
        raise RuntimeError(f"no host interface with index {idx}")

    def _qdiscs(self) -> tuple[str, str]:
        inside = self.host.nsenter(self.container, ["tc", "qdisc", "show", "dev", self._dev])
        outside = _run(["tc", "qdisc", "show", "dev", self._veth])  # type: ignore[list-item]
        return inside, outside

    def inject(self) -> None:
        self._veth = self._host_veth()
        self._before = self._qdiscs()
        tbf = ["root", "tbf", "rate", self.rate, "burst", self.burst, "latency", self.latency]
        self.active = True
        self.host.nsenter(self.container, ["tc", "qdisc", "add", "dev", self._dev, *tbf])
        _run(["tc", "qdisc", "add", "dev", self._veth, *tbf])

    def heal(self) -> None:
        if not self.active:
            return
        if os.path.exists(f"/sys/class/net/{self._veth}"):
            _run(["tc", "qdisc", "del", "dev", self._veth, "root"], check=False)
        if self.host.state(self.container).get("Running"):
            self.host.nsenter(self.container, ["tc", "qdisc", "del", "dev", self._dev, "root"], check=False)
            after = self._qdiscs()
            if after != self._before:
                raise RuntimeError(
                    f"{self.description}: qdiscs after heal {after} differ from before {self._before}"
                )
        self.active = False


ALLOCATOR = (
    "import time\nchunks = []\n"
    "while True:\n    chunks.append(bytearray(16 << 20))\n    time.sleep(0.005)\n"
)  # fmt: skip
#: The allocator started ahead and held until SIGUSR1, with the container's memory already filled to
#: HELD_HEADROOM below its limit: inject() then costs the last few chunks and the kill, not a `docker
#: exec`, an interpreter's start and 1.5 GB of page faults (3-10 s on a loaded 2-core host, all of it
#: inside the push under test, whose sender thread the trigger runs on).
HELD_HEADROOM = 256 << 20
ARMED_ALLOCATOR = f"""
import signal, time
def read(*names):
    for name in names:
        try:
            return int(open(name).read().split()[0])
        except (OSError, ValueError):
            pass
    return 0
def room():  # the container's memory cgroup, v2 or v1
    limit = read("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
    used = read("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory/memory.usage_in_bytes")
    return limit - used if 0 < limit < 1 << 50 else 0  # v1 says "no limit" with a huge number
chunks = []
while room() > {HELD_HEADROOM} + (16 << 20):
    chunks.append(bytearray(16 << 20))
class Go(Exception):
    pass
def go(*_):
    raise Go
signal.signal(signal.SIGUSR1, go)
try:
    while True:
        time.sleep(3600)
except Go:
    pass
while True:
    chunks.append(bytearray(16 << 20))
"""


def _runs_the_allocator(pid: int) -> bool:
    """Whether process `pid` (a host pid) has exec'd the held allocator's script."""
    try:
        return b"signal.SIGUSR1" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _catches_sigusr1(pid: int) -> bool:
    """Whether process `pid` (a host pid) has a handler for SIGUSR1: the held allocator is ready."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next((ln.split()[1] for ln in status.splitlines() if ln.startswith("SigCgt:")), "0")
    return bool(int(caught, 16) & (1 << (signal.SIGUSR1 - 1)))


class OomKill(NetworkPrimitive):
    """Memory pressure past the container's mem_limit: an allocator runs inside the container and the
    kernel's OOM killer ends the container's main process (made the preferred victim through its
    oom_score_adj, as the largest process would be). The container exits 137 with OOMKilled set.
    heal() has nothing to restore: a killed process stays dead (restarting is the deployment's job)."""

    def __init__(self, host: DockerHost, container, victim_is_main: bool = True):
        super().__init__()
        self.host, self.container, self.victim_is_main = host, container, victim_is_main
        self.description = f"{container.name} OOM-killed"
        state = host.state(container)
        container.reload()
        if not container.attrs["HostConfig"].get("Memory"):
            raise ValueError(f"container {container.name} has no mem_limit: nothing to run out of")
        self.init_pid = int(state.get("Pid") or 0)
        self.allocator_pid = self._start_held_allocator()

    def _start_held_allocator(self) -> int:
        """The allocator's host pid, started now and waiting for SIGUSR1; 0 where the engine does not say
        it (inject() then execs the allocator itself)."""
        argv = [sys.executable, "-c", ARMED_ALLOCATOR]
        api = self.host.client.api
        exec_id = api.exec_create(self.container.id, argv)["Id"]
        api.exec_start(exec_id, detach=True)
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            pid = int(api.exec_inspect(exec_id).get("Pid") or 0)
            # held once the interpreter runs the script (before that the pid may still be the runtime's
            # init, which catches every signal) and has set its handler (a SIGUSR1 before would end it)
            if pid and _runs_the_allocator(pid) and _catches_sigusr1(pid):
                return pid
            time.sleep(0.02)
        return 0

    def _main_pids(self) -> list[int]:
        try:
            children = Path(f"/proc/{self.init_pid}/task/{self.init_pid}/children").read_text().split()
        except OSError:
            return []
        return [int(p) for p in children]

    def inject(self, timeout: float = 30.0) -> None:
        """Returns once the kernel killed the victim (the container's main process), so a fault injected
        mid-transfer lands mid-transfer; TimeoutError if it survived `timeout` seconds."""
        victims = self._main_pids() if self.victim_is_main else []
        for pid in victims:  # the rank, under docker-init
            Path(f"/proc/{pid}/oom_score_adj").write_text("1000")
        self.active = True
        if self.allocator_pid:
            os.kill(self.allocator_pid, signal.SIGUSR1)
        else:
            self.host.exec(self.container, ["python", "-c", ALLOCATOR], detach=True)
        deadline = time.monotonic() + timeout
        while any(os.path.exists(f"/proc/{pid}") for pid in victims):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.description}: victim(s) {victims} still alive after {timeout}s")
            time.sleep(0.02)

    def wait(self, timeout: float = 30.0) -> dict[str, Any]:
        """Block until the container exited; returns its State."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.host.state(self.container)
            if not state.get("Running"):
                return state
            time.sleep(0.1)
        raise TimeoutError(f"{self.description}: container still running after {timeout}s")

    def heal(self) -> None:
        self.active = False

"""The network's faults as kinds of the matrix (harness.faults.kinds): a receiver rank on another host (a
container on a Docker bridge, harness.faults.container_rank) loses its link, is partitioned from the
trainer (both ways or one way), drops a fifth of its packets, is capped to 1 MB/s, or is OOM-killed by
the kernel, while version 2 is on the wire. Nothing is simulated: each kind makes the primitive of
harness.faults.docker_net that does it. Their cell (harness.faults.network_cell) needs a Docker engine,
so the matrix's default selection leaves them to the Docker tier (suites/faults/test_network_docker.py)."""

from __future__ import annotations

from harness.faults import docker_net
from harness.faults.injectors import Fault

#: The family of the kinds whose ranks run on other hosts (containers); their cell is network_cell's.
NETWORK = "network"
#: The one point: the fault lands while the trainer transmits bucket 2 of 8 (bucket 1 on the wire).
MID_TRANSMIT = "mid-transmit"
#: The paths whose ranks harness.faults.container_rank places in containers.
CONTAINER_BACKENDS = ("broadcast",)


class NetworkFault(Fault):
    """A fault of the link between the trainer and one receiver rank on another host. The error of the
    faulty push need not name that rank: a cut link times out whichever rank waits on it first."""

    family = NETWORK
    #: the container's memory limit the cell deploys with (the OOM kill's)
    container_options: dict = {}

    def applies(self, backend, caps, deployment):
        return self.applies_to_backend(backend)

    @staticmethod
    def applies_to_backend(backend: str) -> str | None:
        if backend not in CONTAINER_BACKENDS:
            return (
                f"network faults strike ranks on other hosts: only {list(CONTAINER_BACKENDS)}' ranks are placed "
                "in containers (harness.faults.container_rank)"
            )
        return None

    def points(self, caps):
        return (MID_TRANSMIT,)

    def arm(self, ctx, tensors):
        raise TypeError(
            f"{self.kind} arms nothing in a push: its cell (harness.faults.network_cell) injects it"
        )

    def primitive(self, host: docker_net.DockerHost, victim, other) -> docker_net.NetworkPrimitive:
        """What this kind does to the bridge: `victim` is the struck rank's container, `other` another's."""
        raise NotImplementedError


class NetDisconnect(NetworkFault):
    """The victim's container loses its network link (docker network disconnect)."""

    kind = "net-disconnect"

    def primitive(self, host, victim, other):
        return docker_net.Disconnect(host, victim)


class NetPartition(NetworkFault):
    """The victim cannot reach the trainer, both ways; it still reaches the other rank."""

    kind = "net-partition"

    def primitive(self, host, victim, other):
        return docker_net.Partition(host, victim, host.gateway_ip())


class NetOneWay(NetworkFault):
    """The victim hears nothing from the trainer; what it sends still arrives."""

    kind = "net-one-way"

    def primitive(self, host, victim, other):
        return docker_net.OneWayPartition(host, victim, host.gateway_ip())


class NetLoss(NetworkFault):
    """A fifth of the victim's packets are dropped."""

    kind = "net-loss20"

    def primitive(self, host, victim, other):
        return docker_net.PacketLoss(host, victim, 0.2)


class NetBandwidth(NetworkFault):
    """The victim's link capped to 8 Mbit/s (1 MB/s): the 16 MiB version takes ~16 s, past the timeout."""

    kind = "net-bandwidth"

    def primitive(self, host, victim, other):
        return docker_net.BandwidthCap(host, victim, "8mbit")


class NetOom(NetworkFault):
    """The kernel OOM-kills the victim's rank (its container limited to 1.5 GB)."""

    kind = "net-oom"
    container_options = {"mem_limit": "1500m", "memswap_limit": "1500m"}

    def primitive(self, host, victim, other):
        return docker_net.OomKill(host, victim)


KINDS: tuple[type[NetworkFault], ...] = (
    NetDisconnect,
    NetPartition,
    NetOneWay,
    NetLoss,
    NetBandwidth,
    NetOom,
)

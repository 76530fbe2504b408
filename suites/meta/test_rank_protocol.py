"""The trainer <-> rank call protocol is one table (issue 29, item 1): every member of `Engine`, `Receiver`
and `InPlaceLoad` is an operation of harness/ranks/protocol.py or local by design; every operation is
served by the rank loop, by the pipe proxies and, where it names a route, by the HTTP proxies; the
proxies encode what the table says; and a member added to the API without a row is caught."""

from __future__ import annotations

import inspect

import pytest
import torch

from harness import wire
from harness.api import Engine, InPlaceLoad, Receiver, TensorSpec
from harness.backends.control import SupervisedHttpReceiver
from harness.control import remote as http
from harness.control import routes
from harness.launch.pipe_proxies import PipeEngine, PipeInPlaceLoad, PipeReceiver
from harness.launch.rank_server import RankServer
from harness.ranks import protocol
from harness.ranks.protocol import LOCAL, OPS

pytestmark = pytest.mark.meta

RERUN = "Rerun: python -m pytest suites/meta/test_rank_protocol.py -p no:randomly"
API = {"engine": Engine, "receiver": Receiver, "load": InPlaceLoad}
PIPE_PROXIES = {"engine": PipeEngine, "receiver": PipeReceiver, "load": PipeInPlaceLoad}
HTTP_PROXIES = {"engine": http.RemoteEngine, "receiver": http.RemoteReceiver}


def api_members(cls: type) -> list[str]:
    """The public methods and properties a class defines itself (class attributes are not calls)."""
    return [
        name
        for name, value in vars(cls).items()
        if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))
    ]


def uncovered(target: str, cls: type) -> list[str]:
    """Members of `cls` that are neither an operation of the table nor local by design."""
    return [m for m in api_members(cls) if protocol.op_for(target, m) is None and (target, m) not in LOCAL]


def parameters(func) -> tuple[str, ...]:
    return tuple(p for p in inspect.signature(func).parameters if p != "self")


@pytest.mark.parametrize("target", ["engine", "receiver", "load"])
def test_every_api_member_is_an_operation_or_local_by_design(target):
    missing = uncovered(target, API[target])
    assert not missing, (
        f"{API[target].__name__} members {missing} are in no row of harness/ranks/protocol.py's table and "
        f"not in its LOCAL list: add an Op (name, arguments, reply, timeout class, HTTP route) or a reason. {RERUN}"
    )


def test_a_member_added_without_a_row_is_caught():
    class GrownEngine(Engine):
        def defragment(self) -> None: ...

    assert uncovered("engine", GrownEngine) == ["defragment"]


def test_every_operation_is_served_by_the_rank_loop():
    wrong = []
    for op in OPS.values():
        if op.rank_side == "server":
            handler = getattr(RankServer, f"op_{op.name}", None)
            if handler is None or parameters(handler) != op.args:
                wrong.append(f"{op.name}: RankServer.op_{op.name} takes {handler and parameters(handler)}")
        else:
            member = op.api_member
            got = () if op.is_property else parameters(member)
            if got != op.args:
                wrong.append(
                    f"{op.name}: {API[op.target].__name__}.{op.method} takes {got}, the table {op.args}"
                )
        if op.frame is not None and op.frame not in op.args:
            wrong.append(f"{op.name}: its frame {op.frame!r} is not one of its arguments {op.args}")
    handlers = {n.removeprefix("op_") for n in vars(RankServer) if n.startswith("op_")}
    strays = handlers - {op.name for op in OPS.values() if op.rank_side == "server"}
    assert not wrong and not strays, f"rank loop vs table: {wrong}; handlers with no row: {strays}. {RERUN}"


def test_every_operation_of_a_member_is_served_by_the_pipe_proxies():
    wrong = []
    for op in OPS.values():
        if op.method is None:
            assert op.pipe_proxy is None, f"{op.name}: the rank's own operation cannot be proxied"
            continue
        cls = PIPE_PROXIES[op.target]
        member = vars(cls).get(op.method)
        func = member.fget if isinstance(member, property) else member
        made = getattr(func, "rank_op", None)
        if member is None or (op.pipe_proxy == "generated") != (made == op.name):
            wrong.append(
                f"{cls.__name__}.{op.method}: {'missing' if member is None else 'made by ' + str(made)}"
            )
    abstract = {
        c.__name__: sorted(c.__abstractmethods__) for c in PIPE_PROXIES.values() if c.__abstractmethods__
    }
    assert not wrong and not abstract, f"pipe proxies vs table: {wrong}; still abstract: {abstract}. {RERUN}"


def test_every_route_the_table_names_exists_and_the_http_proxies_serve_it():
    served = {(r.method, r.path) for level in routes.VLLM_API_LEVELS for r in routes.table(level)}
    wrong = []
    for op in OPS.values():
        if op.http.startswith("not over HTTP: "):
            assert len(op.http) > len("not over HTTP: "), f"{op.name}: say why it is not over HTTP"
            continue
        method, path = op.http.split(" ", 1)
        if (method, path) not in served:
            wrong.append(f"{op.name}: no route {op.http} in harness/control/routes.py")
        if op.method not in vars(HTTP_PROXIES[op.target]):
            wrong.append(f"{op.name}: {HTTP_PROXIES[op.target].__qualname__} does not serve {op.method}")
    assert not wrong, f"HTTP proxies vs table: {wrong}. {RERUN}"


def test_the_supervised_http_receiver_wraps_every_receiver_operation():
    phases = [op.method for op in OPS.values() if op.target == "receiver"]
    unwrapped = [m for m in phases if vars(SupervisedHttpReceiver).get(m) is None]
    assert not unwrapped, f"SupervisedHttpReceiver leaves {unwrapped} unsupervised. {RERUN}"
    assert inspect.signature(SupervisedHttpReceiver.finish_weight_update) == inspect.signature(
        Receiver.finish_weight_update
    )


class RecordingRank:
    """A rank that records each call as it would go down the pipe and answers from a script."""

    timeout = 6.0

    def __init__(self, replies=None):
        self.calls, self.replies = [], replies or {}

    def call(self, op, timeout=None, tensors=None, **args):
        self.calls.append((op, timeout, tensors, wire.loads(wire.dumps(args))))
        return self.replies.get(op)


def test_the_pipe_proxies_encode_arguments_replies_and_timeouts_as_the_table_says():
    t = {"w": torch.arange(3.0)}
    spec = {"w": TensorSpec((3,), torch.float32)}
    rank = RecordingRank({"weight_spec": wire.spec_to_json(spec), "weight_version": 4, "read_weights": t})
    receiver, engine, load = PipeReceiver(rank), PipeEngine(rank), PipeInPlaceLoad(rank)
    receiver.finish_weight_update(3)
    receiver.abort_weight_update()
    engine.commit_weights(t, 5)
    load.write(t)
    answers = (engine.weight_version, engine.weight_spec(), engine.read_weights())
    assert answers == (4, spec, t), f"decoded replies {answers}; {RERUN}"
    expected = [
        ("finish_weight_update", None, None, {"version": 3}),
        ("abort_weight_update", 2.0, None, {}),  # timeout class "abort": a third of the rank's
        ("commit_weights", None, t, {"version": 5}),  # the tensors as a frame, never JSON
        ("in_place_write", None, t, {}),
        ("weight_version", None, None, {}),
        ("weight_spec", None, None, {}),
        ("read_weights", None, None, {}),
    ]
    assert rank.calls == expected, f"calls down the pipe:\n{rank.calls}\nexpected:\n{expected}\n{RERUN}"


class LoopbackRank:
    """A rank served in this process: each call crosses wire's encodings both ways, as on a pipe."""

    timeout = 5.0

    def __init__(self, server):
        self.server = server

    def call(self, op, timeout=None, tensors=None, **args):
        frame = wire.tensors_from_bytes(wire.tensors_to_bytes(tensors)) if tensors is not None else None
        result, out = self.server.handle(op, wire.loads(wire.dumps(args)), frame)
        result = wire.loads(wire.dumps(result))
        return wire.tensors_from_bytes(wire.tensors_to_bytes(out)) if out is not None else result


def test_the_rank_loop_and_the_pipe_proxy_round_trip_every_kind_of_operation():
    server = RankServer(1, "harness.paths.disk:DiskReceiver", None, {"x": TensorSpec((4,), torch.bfloat16)})
    try:
        engine = PipeEngine(LoopbackRank(server))
        assert engine.weight_spec() == server.engine.weight_spec()
        weights = {n: torch.full_like(t, 0.5) for n, t in engine.read_weights().items()}
        engine.commit_weights(weights, 1)
        assert engine.weight_version == 1
        load = engine.begin_in_place_load(2)
        load.write({"x": torch.ones(4, dtype=torch.bfloat16)})
        load.rollback()
        assert torch.equal(engine.read_weights()["x"], weights["x"]), (
            "a rollback through the table kept a write"
        )
        engine.pause("abort", False)
        assert engine.is_paused
        engine.resume()
        assert not engine.is_paused
        assert protocol.call(engine.rank, "ping") > 0
        with pytest.raises(ValueError, match="unknown rank op 'nope'"):
            server.handle("nope", {}, None)
    finally:
        server.op_exit()


def test_a_proxy_that_hand_writes_a_generated_member_or_lacks_a_hand_one_is_refused():
    class Twice(Receiver):
        def start_weight_update(self) -> None: ...

    with pytest.raises(TypeError, match="written by hand"):
        protocol.pipe_proxy("receiver")(Twice)

    class Lacking(Engine):
        pass

    with pytest.raises(TypeError, match="must write"):
        protocol.pipe_proxy("engine")(Lacking)

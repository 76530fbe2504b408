"""The trainer <-> rank call protocol, as one table: every operation a parent sends down a rank's pipe,
with the `Engine` / `Receiver` / `InPlaceLoad` member it serves, its arguments and how each is encoded
(JSON through `harness.wire`, tensors as one safetensors frame; never pickle), how its reply is encoded,
its timeout class, and its HTTP route.

Made from the table:
- the rank loop's dispatch (`serve`, called by `harness.launch.rank_server`'s rank process): an operation that only
  calls its member on the rank's engine or receiver is served from the table alone; one that keeps state
  on the rank (open streams, an open in-place load) or is the rank's own (ping, reset, exit) is served
  by the rank server's method `op_<name>`;
- the pipe proxies' methods (`pipe_proxy`, a class decorator on `harness.launch.pipe_proxies`' `PipeReceiver`,
  `PipeEngine` and its in-place load): real methods and properties with the API's signatures, which
  encode, call with the operation's timeout and decode. The few that do more than that on the trainer's
  side (submit feeds local streams; pause and abort_requests show their effect in those streams on return;
  begin_in_place_load hands back a load object) are written by hand, call through `call`, and are marked
  `"hand"` here, so a test finds them.

The HTTP proxies (`harness.control.remote`) are not made from the table: their mapping differs route by
route in ways a column cannot carry without contortion (the version is parsed from /weight_status's
label, an abort falls back to a `discard` where vLLM has no route, the oracle and the model config come
from another reader, commit is refused). Instead `http` names each operation's route, or says why it
has none, and suites/meta/test_rank_protocol.py checks the routes exist and the HTTP classes serve them.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol

from harness import wire
from harness.api import Engine, InPlaceLoad, Receiver

Target = Literal["receiver", "engine", "load", "rank"]

#: Timeout classes: "call", the rank's own timeout (RPC_SLACK x the deployment's: the data plane's own
#: timeout fires first with its specific error); "abort", a third of it and at least 1 s (after a failed
#: transfer a rank that cannot answer this quickly is killed, not waited for); "given", what the caller
#: passes (a poll: what is left of its deadline after waiting for the pipe; exit: the stop's timeout).
TimeoutClass = Literal["call", "abort", "given"]

TARGETS: dict[str, type] = {"receiver": Receiver, "engine": Engine, "load": InPlaceLoad}


@dataclasses.dataclass(frozen=True)
class Codec:
    """How one value crosses the pipe: `to_json` on the sending side, `from_json` on the receiving one."""

    to_json: Callable[[Any], Any]
    from_json: Callable[[Any], Any]


PLAIN = Codec(lambda v: v, lambda v: v)
SPEC = Codec(wire.spec_to_json, wire.spec_from_json)
SPEC_REPLY = Codec(wire.spec_to_json, lambda d: wire.spec_from_json(d) or {})
REQUEST = Codec(wire.request_to_json, wire.request_from_json)
IDS = Codec(list, lambda v: v)
#: A reply that comes back as a safetensors frame (the rank's tensors), not JSON.
TENSORS = "tensors"


@dataclasses.dataclass(frozen=True, eq=False)
class Op:
    """One operation. `method`: the member of `TARGETS[target]` it serves (None: the rank's own).
    `args`: its arguments in the member's order; `codecs` those not sent as they are; `frame` the one
    (a mapping of tensors) sent as a safetensors frame. `rank_side`: "target" calls the member on the
    rank's engine or receiver, "server" the rank server's `op_<name>`. `pipe_proxy`: "generated" (made
    by `pipe_proxy`), "hand" (written in the proxy class, calling `call`), None (the rank's own: its
    callers use `call`). `http`: "METHOD /route", or "not over HTTP: why"."""

    name: str
    target: Target
    method: str | None = None
    args: tuple[str, ...] = ()
    codecs: Mapping[str, Codec] = dataclasses.field(default_factory=dict)
    frame: str | None = None
    reply: Codec | str = PLAIN
    timeout: TimeoutClass = "call"
    rank_side: Literal["target", "server"] = "target"
    pipe_proxy: Literal["generated", "hand"] | None = "generated"
    http: str = "not over HTTP: the rank's own"

    def codec(self, arg: str) -> Codec:
        return self.codecs.get(arg, PLAIN)

    @property
    def api_member(self) -> Any:
        """The API's function or property this operation serves (None for the rank's own)."""
        return None if self.method is None else inspect.getattr_static(TARGETS[self.target], self.method)

    @functools.cached_property
    def is_property(self) -> bool:
        return isinstance(self.api_member, property)

    @functools.cached_property
    def signature(self) -> inspect.Signature:
        """The API member's signature, which `call` binds its arguments with (made once: binding with a
        fresh inspect.signature cost more than the pipe's round trip, 2026-12-04)."""
        member = self.api_member
        return inspect.signature(member.fget if isinstance(member, property) else member)


_NOT_HTTP_DIRECT = "not over HTTP: read from the engine reached another way (`direct`, e.g. the rank's pipe)"
_NOT_HTTP_LOAD = "not over HTTP: the control plane commits only through the receiver's lifecycle"

_TABLE: tuple[Op, ...] = (
    # the receiver's lifecycle (vLLM's four phases and the abort beyond them)
    Op("init_transfer_engine", "receiver", "init_transfer_engine", ("init_info",),
       http="POST /init_weight_transfer_engine"),
    Op("start_weight_update", "receiver", "start_weight_update", http="POST /start_weight_update"),
    Op("update_weights", "receiver", "update_weights", ("update_info",), http="POST /update_weights"),
    Op("finish_weight_update", "receiver", "finish_weight_update", ("version",),
       http="POST /finish_weight_update"),
    Op("abort_weight_update", "receiver", "abort_weight_update", timeout="abort",
       http="POST /abort_weight_update"),  # vLLM has none: the HTTP receiver's `discard` stands in
    # the engine: what it holds
    Op("weight_version", "engine", "weight_version", http="GET /weight_status"),
    Op("weight_spec", "engine", "weight_spec", reply=SPEC_REPLY, http="GET /weight_spec"),
    Op("model_config", "engine", "model_config", http=_NOT_HTTP_DIRECT),
    Op("max_running_requests", "engine", "max_running_requests", http=_NOT_HTTP_DIRECT),
    Op("read_weights", "engine", "read_weights", reply=TENSORS,
       http="not over HTTP: the oracle reads the live weights without going through any path"),
    Op("commit_weights", "engine", "commit_weights", ("tensors", "version"), frame="tensors",
       http=_NOT_HTTP_LOAD),
    # in-place loads: the load stays open on the rank between calls
    Op("in_place_begin", "engine", "begin_in_place_load", ("version",), rank_side="server", pipe_proxy="hand",
       http=_NOT_HTTP_LOAD),
    Op("in_place_write", "load", "write", ("named_tensors",), frame="named_tensors", rank_side="server",
       http=_NOT_HTTP_LOAD),
    Op("in_place_commit", "load", "commit", rank_side="server", http=_NOT_HTTP_LOAD),
    Op("in_place_rollback", "load", "rollback", rank_side="server", http=_NOT_HTTP_LOAD),
    # serving: the rank keeps each open request's stream; the parent polls their events
    Op("submit", "engine", "submit", ("request",), {"request": REQUEST}, rank_side="server", pipe_proxy="hand",
       http="POST /v1/completions"),
    Op("poll", "rank", args=("after", "wait"), timeout="given", rank_side="server", pipe_proxy=None),
    Op("abort_requests", "engine", "abort_requests", ("request_ids",), {"request_ids": IDS}, pipe_proxy="hand",
       http="not over HTTP: the HTTP engine leaves it to the base class (a RemoteStream aborts its own)"),
    Op("pause", "engine", "pause", ("mode", "clear_cache"), pipe_proxy="hand", http="POST /pause"),
    Op("resume", "engine", "resume", http="POST /resume"),
    Op("is_paused", "engine", "is_paused", http="GET /is_paused"),
    Op("reset_prefix_cache", "engine", "reset_prefix_cache", http="POST /reset_prefix_cache"),
    # the rank's own
    Op("reset", "rank", args=("spec",), codecs={"spec": SPEC}, rank_side="server", pipe_proxy=None),
    Op("ping", "rank", rank_side="server", pipe_proxy=None),
    Op("take_phases", "rank", rank_side="server", pipe_proxy=None),
    Op("weight_digests", "rank", rank_side="server", pipe_proxy=None),
    Op("serve_control", "rank", args=("token", "allowed_dirs"), rank_side="server", pipe_proxy=None),
    Op("exit", "rank", timeout="given", rank_side="server", pipe_proxy=None),
)  # fmt: skip

#: Every operation by name.
OPS: dict[str, Op] = {op.name: op for op in _TABLE}
assert len(OPS) == len(_TABLE), "two operations share a name"

#: Members of the API that never cross the pipe, and why (a proxy inherits the API's default, which
#: composes the members that do cross).
LOCAL: dict[tuple[str, str], str] = {
    ("engine", "generate"): "submits each request (the `submit` operation) and waits on the local streams",
    ("engine", "read_weights_into"): "the API's default copies what `read_weights` returns",
    ("engine", "check_update"): "the API's default asks `weight_version` and `weight_spec`",
    ("engine", "shutdown"): "the rank's engine shuts down at `exit` (RankProcess.stop)",
    ("receiver", "shutdown"): "the rank's receiver shuts down at `exit` (RankProcess.stop)",
}


def op_for(target: str, method: str) -> Op | None:
    """The operation that serves `method` of `target` ("engine", "receiver", "load"), if any."""
    return next((op for op in _TABLE if op.target == target and op.method == method), None)


# ============================================================================ the trainer's side
class Rank(Protocol):
    """What `call` needs of a rank: `call(name, timeout, tensors, **json_args)` and its `timeout`
    (harness.launch.supervision.RankProcess)."""

    timeout: float

    def call(
        self, op: str, timeout: float | None = None, tensors: Mapping[str, Any] | None = None, **args
    ): ...


def call(rank: Rank, name: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
    """Run operation `name` on `rank` with the arguments its member takes (bound as the API's signature
    binds them, defaults included), encoded as the table says, within its timeout class (`timeout`
    overrides it); returns the decoded reply or raises what the rank raised."""
    op, timeout, frame, json_args = _encode(rank, name, args, kwargs, timeout)
    reply = rank.call(name, timeout=timeout, tensors=frame, **json_args)
    return reply if op.reply == TENSORS else op.reply.from_json(reply)


class Pending(Protocol):
    """A call sent and not yet answered (harness.launch.supervision.PendingCall)."""

    def wait(self, timeout: float | None = None) -> bool: ...

    def result(self) -> Any: ...


def begin(rank: Any, name: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Pending | None:
    """`call`, sent now and answered later: the reply (decoded) or what the rank raised comes from
    `result()` of what this returns. None where the rank cannot send it without blocking (no `begin`, a
    tensor frame, a large request): the caller makes the call instead."""
    op, timeout, frame, json_args = _encode(rank, name, args, kwargs, timeout)
    if frame is not None or op.reply == TENSORS or not hasattr(rank, "begin"):
        return None
    sent = rank.begin(name, timeout=timeout, **json_args)
    return None if sent is None else _Decoded(sent, op.reply)


@dataclasses.dataclass(frozen=True)
class _Decoded:
    sent: Pending
    codec: Codec

    def wait(self, timeout: float | None = None) -> bool:
        return self.sent.wait(timeout)

    def result(self) -> Any:
        return self.codec.from_json(self.sent.result())


def _encode(
    rank: Rank, name: str, args: tuple, kwargs: dict, timeout: float | None
) -> tuple[Op, float | None, dict | None, dict[str, Any]]:
    op = OPS[name]
    if op.method is not None:
        bound = op.signature.bind(None, *args, **kwargs)
        bound.apply_defaults()
        values = {a: bound.arguments[a] for a in op.args}
    else:
        if args or set(kwargs) != set(op.args):
            raise TypeError(f"rank operation {name!r} takes keyword arguments {op.args}, got {args} {kwargs}")
        values = dict(kwargs)
    frame = None
    if op.frame is not None:
        frame = values.pop(op.frame)
        frame = None if frame is None else dict(frame)
    if timeout is None and op.timeout == "abort":
        timeout = max(rank.timeout / 3, 1.0)
    return op, timeout, frame, {a: op.codec(a).to_json(v) for a, v in values.items()}


def _proxy_member(op: Op, owner: type) -> Any:
    member = op.api_member
    func = member.fget if isinstance(member, property) else member

    def proxy(self, *args: Any, **kwargs: Any) -> Any:
        return call(self.rank, op.name, *args, **kwargs)

    proxy.__name__ = op.method
    proxy.__qualname__ = f"{owner.__qualname__}.{op.method}"
    proxy.__doc__ = f"Operation {op.name!r} on the rank (harness.ranks.protocol)."
    proxy.__signature__ = inspect.signature(func)
    proxy.rank_op = op.name
    return property(proxy) if op.is_property else proxy


def pipe_proxy(target: str) -> Callable[[type], type]:
    """Class decorator: give the class (which holds its rank as `self.rank`) a method or property for
    every operation of `target` marked "generated"; the class must write those marked "hand" itself."""

    def decorate(cls: type) -> type:
        for op in _TABLE:
            if op.target != target or op.pipe_proxy is None:
                continue
            written = op.method in cls.__dict__
            if op.pipe_proxy == "generated" and written:
                raise TypeError(
                    f"{cls.__name__}.{op.method} is written by hand; the table marks {op.name!r} generated"
                )
            if op.pipe_proxy == "hand" and not written:
                raise TypeError(f"{cls.__name__} must write {op.method} (the table marks {op.name!r} 'hand')")
            if op.pipe_proxy == "generated":
                setattr(cls, op.method, _proxy_member(op, cls))
        abc.update_abstractmethods(cls)
        return cls

    return decorate


# ============================================================================ the rank's side
def serve(server: Any, name: str, args: Mapping[str, Any], tensors: dict[str, Any] | None) -> tuple[Any, Any]:
    """The rank loop's dispatch: run operation `name` on `server` (which has `target(kind)`, its engine or
    receiver now, and `op_<name>` for operations it serves itself); returns (JSON reply, tensors or None)."""
    op = OPS.get(name)
    if op is None:
        raise ValueError(f"unknown rank op {name!r}")
    values = [(tensors or {}) if a == op.frame else op.codec(a).from_json(args[a]) for a in op.args]
    if op.rank_side == "server":
        result = getattr(server, f"op_{name}")(*values)
    else:
        member = getattr(server.target(op.target), op.method)
        result = member if op.is_property else member(*values)
    if op.reply == TENSORS:
        return None, result
    return op.reply.to_json(result), None

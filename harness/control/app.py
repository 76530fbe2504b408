"""Running a ControlServer: uvicorn in a background thread, bounded against idle and slow clients, and
the command line (`python -m harness.control.app`).

The server stays up under idle and slow clients (see `limits`): a request's headers and its body each
have a deadline, open connections are capped below this process's file limit (an idle one is closed
to make room for a new one), and streams share a bounded pool of threads."""

from __future__ import annotations

import argparse
import json
import logging
import secrets
import sys
import threading
import time
from pathlib import Path
from typing import Any

from harness.api import Engine, Receiver
from harness.control import routes
from harness.control.limits import ACCEPT_BACKLOG, ClientLimits, bounded_h11_protocol
from harness.control.routes import DEFAULT_VLLM_API, VLLM_API_LEVELS
from harness.control.server import (
    DEFAULT_HOST,
    LOOPBACK_HOSTS,
    SERVER_NAME,
    TOKEN_VARIABLES,
    ControlServer,
    ServerConfig,
    is_loopback,
    token_from_environment,
)

__all__ = ["ClientLimits", "ServerThread", "main", "serve"]

log = logging.getLogger("weightsync.control")


# --------------------------------------------------------------------------------------------- running
class ServerThread:
    """uvicorn serving a ControlServer from a background thread; `port` is the bound port."""

    def __init__(self, server: ControlServer, log_level: str = "warning", limits: ClientLimits | None = None):
        import uvicorn

        self.server = server
        self.limits = limits or ClientLimits()
        host = server.config.host
        self._uvicorn = uvicorn.Server(
            uvicorn.Config(
                server.asgi,
                host=host,
                port=server.config.port,
                http=bounded_h11_protocol(self.limits, server.counters),
                backlog=ACCEPT_BACKLOG,
                log_level=log_level,
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=2,
                timeout_keep_alive=30,
                h11_max_incomplete_event_size=64 * 1024,  # bounds header size
            )
        )
        self._thread = threading.Thread(target=self._uvicorn.run, name="control-server", daemon=True)
        self.port: int | None = None

    @property
    def url(self) -> str:
        host = self.server.config.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"control server on {self.server.config.host} exited during startup")
            if time.monotonic() > deadline:
                raise TimeoutError(f"control server did not start within {timeout}s")
            self._thread.join(0.01)
        self.port = self._uvicorn.servers[0].sockets[0].getsockname()[1]
        if not self.server.config.auth:
            log.warning(
                "control server on %s: authentication is off (no token; loopback only, so any process on "
                "this machine may call every route)",
                self.url,
            )
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.close()
        self._uvicorn.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> ServerThread:  # noqa: PYI034 - Self needs Python 3.11
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(
    engine: Engine,
    receiver: Receiver,
    token: str | None = None,
    host: str = DEFAULT_HOST,
    port: int = 0,
    limits: ClientLimits | None = None,
    **config: Any,
) -> ServerThread:
    """Start a control server in this process (the token from the environment when none is given, else
    a random one: read it back from `.server.config.token`). Binds loopback unless `host` says otherwise."""
    token = token or token_from_environment() or secrets.token_urlsafe(32)
    cfg = ServerConfig(token=token, host=host, port=port, **config)
    return ServerThread(ControlServer(engine, receiver, cfg), limits=limits).start()


# --------------------------------------------------------------------------------------------- CLI
def control_receivers() -> dict[str, str]:
    """{path name: its receiver} for the built-in paths whose Backend declares a `control_receiver`."""
    from harness.registry import BUILTIN_BACKENDS, resolve_backend

    found = {name: resolve_backend(name, "cpu").control_receiver for name in BUILTIN_BACKENDS}
    return {name: path for name, path in found.items() if path}


#: The command line's flags for the client limits: (flag, its ClientLimits field and default, type, meaning).
_CLIENT_LIMIT_FLAGS = (
    ("--header-timeout", "header_timeout_s", float, "seconds a request's headers may take"),
    ("--body-timeout", "body_timeout_s", float, "seconds a request's body may take after its headers"),
    ("--max-connections", "max_connections", int, "open connections at most, held below the file limit"),
)


def main(argv: list[str] | None = None) -> int:
    """`python -m harness.control.app --path disk --allowed-dir DIR`; the token comes from
    --token-file, $WEIGHTSYNC_CONTROL_TOKEN or $VLLM_API_KEY (never the command line, which `ps` shows).
    Without one the server runs unauthenticated on a loopback address (and says so) and refuses any other."""
    from harness.registry import load_object, make_engine

    receivers = control_receivers()
    ap = argparse.ArgumentParser(prog="python -m harness.control.app", description=main.__doc__)
    ap.add_argument(
        "--engine", default="reference", help="engine: reference, reference-tied or pkg.module:factory"
    )
    ap.add_argument("--path", default="disk", help=f"receiver: {sorted(receivers)} or pkg.module:Class")
    ap.add_argument("--host", default=DEFAULT_HOST)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument(
        "--allowed-dir", action="append", default=[], help="directory update paths may name (repeat)"
    )
    ap.add_argument(
        "--allowed-host", action="append", default=[], help="peer address init_info may name (repeat)"
    )
    ap.add_argument("--init-override", default="{}", help="JSON merged over every init_info (e.g. this rank)")
    ap.add_argument("--token-file", help="file holding the bearer token")
    ap.add_argument("--max-body-bytes", type=int, default=1 << 20)
    ap.add_argument("--workdir", help="where /sleep offloads weights (default: a temporary directory)")
    ap.add_argument("--worker-index", type=int, default=0, help="this server's element of a list update_info")
    ap.add_argument("--world-size", type=int, default=1, help="what /get_world_size answers")
    for flag, field, kind, what in _CLIENT_LIMIT_FLAGS:
        ap.add_argument(
            flag, type=kind, default=getattr(ClientLimits, field), help=f"{what} (default %(default)s)"
        )
    ap.add_argument(
        "--served-model-name", default=SERVER_NAME, help="the model name completions must name (vLLM's flag)"
    )
    ap.add_argument(
        "--sse-keepalive",
        type=float,
        default=None,
        help="seconds between ': keepalive' comments on an idle stream (default: none, as vLLM)",
    )
    ap.add_argument(
        "--vllm-api",
        default=DEFAULT_VLLM_API,
        metavar="LEVEL",
        help=f"which vLLM's RL routes to serve: {' or '.join(VLLM_API_LEVELS)} (the RL CI-matrix prototype's "
        "/weight_update_active, /update_weight_label, weight_gen); default %(default)s",
    )
    ap.add_argument("--log-level", default="warning")
    args = ap.parse_args(argv)

    token = Path(args.token_file).read_text().strip() if args.token_file else token_from_environment()
    if not token and not is_loopback(args.host):
        ap.error(
            f"no token for --host {args.host}: a non-loopback address requires one; set "
            f"{' or '.join(TOKEN_VARIABLES)} or pass --token-file"
        )
    try:
        routes.check_level(args.vllm_api)
    except ValueError as exc:
        ap.error(str(exc))
    engine = make_engine(args.engine, None)
    receiver = load_object(receivers.get(args.path, args.path))(engine)
    cfg = ServerConfig(
        token=token or None,
        host=args.host,
        port=args.port,
        allowed_dirs=tuple(Path(d) for d in args.allowed_dir),
        allowed_hosts=tuple(args.allowed_host) or LOOPBACK_HOSTS,
        init_overrides=json.loads(args.init_override),
        max_body_bytes=args.max_body_bytes,
        workdir=Path(args.workdir) if args.workdir else None,
        worker_index=args.worker_index,
        world_size=args.world_size,
        model_name=args.served_model_name,
        keepalive_s=args.sse_keepalive,
        vllm_api=args.vllm_api,
    )
    limits = ClientLimits(args.header_timeout, args.body_timeout, args.max_connections)
    thread = ServerThread(
        ControlServer(engine, receiver, cfg), log_level=args.log_level, limits=limits
    ).start()
    if not cfg.auth:
        print(
            f"weightsync control server: authentication is off (no token; {args.host} is loopback)",
            flush=True,
        )
    if cfg.vllm_api != DEFAULT_VLLM_API:
        print(f"weightsync control server: vLLM API level {cfg.vllm_api}", flush=True)
    print(f"weightsync control server listening on {thread.url}", flush=True)
    try:
        while thread._thread.is_alive():
            thread._thread.join(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        thread.stop()
        receiver.shutdown()
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

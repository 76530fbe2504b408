"""HTTP control plane: vLLM's dev-mode routes in front of any Engine + Receiver, and a client for both.

- `schemas`: the strict request bodies (pydantic, extra=forbid) and the validators shared by both ends.
- `routes`: the one route table (method, path, body, query, precondition, handler, error statuses) that
  the server registers, its OpenAPI document lists, the client checks its calls against, and the fuzz
  test enumerates; `table(vllm_api)` is a vLLM API level's ("0.32", the default, or "rfc45585").
- `server`: `ControlServer` (the operations behind each route, app assembly). Its rooms: `errors` (vLLM's error object, the exception -> status map),
  `guard` (token and body limit, before routing), `idempotency` (Idempotency-Key replays), `streaming`
  (/v1/completions and /abort_requests).
- `app`: running it: `ServerThread` (uvicorn in a thread, bounded against idle and slow clients),
  `serve`, and the CLI (`python -m harness.control.app`).
- `client`: `ControlClient`, an httpx client with the four-phase API, timeouts and safe retries.
- `remote`: `RemoteReceiver`, `RemoteEngine` and `RemoteDeployment`, so `harness.deployment.push()`
  and the suites drive a remote server as if it were local.

HTTP carries metadata only; tensors travel on the data plane of a path (disk, broadcast).
"""

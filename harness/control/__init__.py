"""HTTP control plane: vLLM's dev-mode routes in front of any Engine + Receiver, and a client for both.

- `schemas`: the strict request bodies (pydantic, extra=forbid) and the validators shared by both ends.
- `server`: the FastAPI app (`ControlServer`) and `ServerThread`, which runs it under uvicorn.
- `client`: `ControlClient`, an httpx client with the four-phase API, timeouts and safe retries.
- `remote`: `RemoteReceiver`, `RemoteEngine` and `RemoteDeployment`, so `harness.deployment.push()`
  and the suites drive a remote server as if it were local.

HTTP carries metadata only; tensors travel on the data plane of a path (disk, broadcast).
"""

"""harness.error_codec, the one translation of harness exceptions across a boundary: the class survives each
carrier (rank pipe JSON, HTTP answers, vLLM's relayed text), an unknown name never becomes an importable class,
and every harness error has the status the control plane answers with."""

from __future__ import annotations

import pytest

from harness import api
from harness.error_codec import from_http, from_json, from_message, http_status, to_json

pytestmark = pytest.mark.meta


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (api.VersionError("v3 is not newer than v4"), 409),
        (api.LifecycleError("finish before start"), 409),
        (api.UnknownTensorError("no tensor named x"), 422),
        (api.ManifestMismatch("digest"), 422),
        (api.TransferError("cut"), 502),
        (api.BackendError("bad config"), 400),
        (TimeoutError("slow"), 504),
    ],
)
def test_every_carrier_keeps_the_class(exc, status):
    back = from_json(to_json(exc), "rank 2")
    assert type(back) is type(exc) and str(back) == f"{exc} [raised in rank 2]", back
    assert "Traceback" in back.remote_traceback or back.remote_traceback.strip(), back.remote_traceback
    assert http_status(exc) == status
    if isinstance(exc, api.WeightSyncError):
        body = {"error": {"message": str(exc), "type": type(exc).__name__, "param": None, "code": status}}
        over_http = from_http(status, body, "[HTTP]")
        assert type(over_http) is type(exc) and over_http.status == status, over_http
        relayed = (
            f"Worker failed with error '{type(exc).__name__}: {exc}', please check the stack trace above"
        )
        assert from_message(relayed) == (type(exc), str(exc)), from_message(relayed)


def test_an_unknown_or_unsafe_name_is_rebuilt_as_runtime_error():
    for name in ("SystemExit", "os.system", "NotAClass", "Popen"):
        back = from_json({"type": name, "message": "m"}, "rank 1")
        assert type(back) is RuntimeError, (name, type(back))
    assert from_http(500, {"error": {"type": "Internal", "message": "boom"}}, "[HTTP]") is None
    assert from_message("ValueError: not a harness error") is None
    assert http_status(RuntimeError("crash")) is None, "a crash is no answer: the server says 500"

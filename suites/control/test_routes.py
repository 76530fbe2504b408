"""One route table (`harness.control.routes.ROUTES`) read by the server, its OpenAPI document, the
client and the fuzz test: each is checked here against the table."""

from __future__ import annotations

import httpx
import pytest

from harness.control import routes
from harness.control.routes import ROUTES
from suites.control import test_fuzz


def _documented_errors(operation: dict) -> set[int]:
    return {int(status) for status in operation["responses"] if not status.startswith("2")}


def test_the_server_serves_exactly_the_table(served):
    served_routes = {
        (method, r.path)
        for r in served.server.app.routes
        if r.path not in ("/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect")
        for method in getattr(r, "methods", ()) - {"HEAD"}
    }
    table = {(r.method, r.path) for r in ROUTES}
    assert served_routes == table, (
        f"served but not in the table: {sorted(served_routes - table)}; "
        f"in the table but not served: {sorted(table - served_routes)}"
    )


def test_openapi_lists_exactly_the_declared_error_statuses_of_every_route(served):
    doc = httpx.get(served.url + "/openapi.json").json()
    wrong = {}
    for r in ROUTES:
        operation = doc["paths"].get(r.path, {}).get(r.method.lower())
        assert operation is not None, f"{r.method} {r.path} is missing from /openapi.json"
        documented, declared = _documented_errors(operation), set(r.error_statuses(auth=True))
        if documented != declared:
            wrong[f"{r.method} {r.path}"] = (sorted(documented), sorted(declared))
        for status in declared:
            schema = operation["responses"][str(status)]["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/ErrorResponse"}, (r.path, status, schema)
    assert not wrong, f"route: (documented, declared by the table): {wrong}"
    assert {"401"} <= set(doc["paths"]["/update_weights"]["post"]["responses"]), "401 missing with auth on"


def test_openapi_documents_every_body_from_the_table(served):
    doc = httpx.get(served.url + "/openapi.json").json()
    for r in ROUTES:
        if r.body is None:
            continue
        body = doc["paths"][r.path][r.method.lower()].get("requestBody")
        assert body == routes.openapi_request_body(r), f"{r.path}: requestBody {body}"
        assert r.body.__name__ in doc["components"]["schemas"], f"{r.path}: no schema {r.body.__name__}"


def test_the_client_refuses_a_call_the_table_lacks(served):
    client = served.new_client()
    for method, path, params in [("POST", "/no_such_route", None), ("GET", "/pause", None),
                                 ("POST", "/pause", {"bogus": "1"})]:  # fmt: skip
        with pytest.raises(ValueError, match="harness.control.routes|query parameters"):
            client._call(method, path, params=params)
    assert client.attempts == [], f"a call the table lacks was sent: {client.attempts}"


def test_the_fuzz_test_enumerates_the_table():
    posts = {r.path for r in ROUTES if r.method == "POST"}
    gets = {r.path for r in ROUTES if r.method == "GET"}
    assert set(test_fuzz.POST_ROUTES) == posts and set(test_fuzz.GET_ROUTES) == gets
    assert set(test_fuzz.VALID_BODY) == posts, (
        f"routes without a sample body in test_fuzz.VALID_BODY: {sorted(posts - set(test_fuzz.VALID_BODY))}"
    )
    assert set(test_fuzz.LIFECYCLE_GATED) == {r.path for r in ROUTES if r.precondition}

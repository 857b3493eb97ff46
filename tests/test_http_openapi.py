"""The OpenAPI document: valid OpenAPI 3.1, request/response JSON schemas that match what the server
really accepts and returns, and a property-based run (schemathesis) against a loopback server that
must find no 5xx and no response outside the documented statuses, content types and schemas."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from openapi_spec_validator import validate as validate_openapi
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.http_helpers import ServerThread, b64, image_bytes
from tests.http_helpers import settings as serve_settings

IMAGE = b64(image_bytes(96, 64, seed=1))


@pytest.fixture(scope="module")
def server():
    with ServerThread(serve_settings(max_items_per_request=4, max_payload_bytes=512 * 1024)) as srv:
        yield srv


@pytest.fixture(scope="module")
def document(server):
    return httpx.get(server.url + "/openapi.json").json()


def component_validator(document: dict, name: str) -> jsonschema.Draft202012Validator:
    """A validator for one component schema, resolving #/components/... references in the document."""
    schema = {"$ref": f"#/components/schemas/{name}", "components": document["components"]}
    return jsonschema.Draft202012Validator(schema)


def test_document_is_valid_openapi(document, server):
    validate_openapi(document)
    assert document["openapi"].startswith("3.1")
    assert set(document["paths"]) >= {"/encode", "/health", "/ready", "/metrics", "/info"}
    encode = document["paths"]["/encode"]["post"]
    assert set(encode["requestBody"]["content"]) == {"application/json", "multipart/form-data"}
    assert {"200", "401", "413", "422", "429", "500", "503", "504"} <= set(encode["responses"])
    for name, schema in document["components"]["schemas"].items():
        jsonschema.Draft202012Validator.check_schema(schema), name
    assert httpx.get(server.url + "/docs").status_code == 200


def test_the_bearer_scheme_is_declared_with_an_api_key(document):
    assert "securitySchemes" not in document.get("components", {})  # no key, no scheme
    with ServerThread(serve_settings(api_key="k-123")) as srv:
        keyed = httpx.get(srv.url + "/openapi.json").json()
    validate_openapi(keyed)
    assert keyed["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http", "scheme": "bearer", "description": keyed["components"]["securitySchemes"]["bearerAuth"]
        ["description"]}
    assert keyed["paths"]["/encode"]["post"]["security"] == [{"bearerAuth": []}]
    assert keyed["paths"]["/info"]["get"]["security"] == [{"bearerAuth": []}]
    for path in ("/health", "/ready", "/metrics"):
        assert "security" not in keyed["paths"][path]["get"], path
    assert "k-123" not in json.dumps(keyed)


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_load_everything_from_the_server_itself(server, page):
    """No CDN, no web fonts, no validator badge: the pages work in an air-gapped cluster."""
    html = httpx.get(server.url + page).text
    assert "http://" not in html and "https://" not in html and "//" not in html.replace("<!--", "")
    refs = re.findall(r'(?:src|href|spec-url)="([^"]+)"', html) + re.findall(r"url: '([^']+)'", html)
    assert refs and all(ref.startswith("/") for ref in refs), refs
    for ref in refs:
        r = httpx.get(server.url + ref)
        assert r.status_code == 200 and r.content, ref
    if page == "/docs":
        assert '"validatorUrl": null' in html  # Swagger UI would otherwise ask validator.swagger.io


def test_request_schema_matches_the_server(document, server):
    request = component_validator(document, "EncodeRequest")
    good = [
        {"items": [{"type": "image", "image": IMAGE}]},
        {"items": [{"type": "image", "image": IMAGE, "min_pixels": 3136, "max_pixels": 200704, "id": "a-1"}],
         "encoding_format": "base64", "dtype": "bfloat16", "include_deepstack": True},
    ]
    bad = [
        {},
        {"items": []},
        {"items": [{"type": "image"}]},
        {"items": [{"type": "gif", "image": IMAGE}]},
        {"items": [{"type": "image", "image": IMAGE, "colour": 1}]},
        {"items": [{"type": "image", "image": IMAGE}], "dtype": "int8"},
        {"items": [{"type": "video", "video": IMAGE, "nframes": 1}]},
        {"items": [{"type": "image", "image": IMAGE, "id": "a/b"}]},
    ]
    with server.client() as c:
        for body in good:
            request.validate(body)
            r = c.post("/encode", json=body)
            assert r.status_code == 200, r.text
            component_validator(document, "EncodeResponse").validate(r.json())
        for body in bad:
            assert not request.is_valid(body), body
            r = c.post("/encode", json=body)
            assert r.status_code == 422, body
            component_validator(document, "ErrorResponse").validate(r.json())


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture(scope="module")
def api_schema(server, document):
    # Only the endpoints a client can break; /metrics is plain text and /docs is HTML.
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


@schema.include(path_regex="^/(encode|health|ready|info)$").parametrize()
@settings(max_examples=60, deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
def test_property_based_no_server_errors(case):
    response = case.call_and_validate(checks=[not_a_server_error, status_code_conformance,
                                              content_type_conformance, response_schema_conformance])
    assert response.status_code < 500, response.text


def test_error_bodies_are_documented(document, server):
    error = component_validator(document, "ErrorResponse")
    with server.client() as c:
        responses = [
            c.post("/encode", content=b"x", headers={"content-type": "text/plain"}),
            c.post("/encode", content=json.dumps({"items": [{"type": "image", "image": "A" * 600_000}]})),
            c.get("/nowhere"),
        ]
    assert [r.status_code for r in responses] == [415, 413, 404]
    for r in responses:
        error.validate(r.json())

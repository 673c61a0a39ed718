"""docs/from-vllm.md's Endpoints table says what the server does: every path of a "served" row
is routed (its answer is not the router's 404), and every path of a "not served" row answers
404 with the OpenAI error body whose code is `not_found` and which names no field."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient
from support import structured as model

from atombatch.serve.app import create_app

DOC = Path(__file__).resolve().parents[2] / "docs" / "from-vllm.md"


def endpoint_rows() -> list[tuple[str, str, str]]:
    """(method, path, "served" | "not served") for every path of the Endpoints table; a path
    without a method takes the one before it in its row (POST when the row names none), and a
    `{...}` parameter becomes `x`. Wildcard entries (`/v1/audio/*`) are skipped."""
    section = DOC.read_text().split("\n## Endpoints\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or cells[1] not in ("served", "not served"):
            continue
        method = "POST"
        for span in re.findall(r"`([^`]+)`", cells[0]):
            words = span.split()
            if words[0] in ("GET", "POST"):
                method, words = words[0], words[1:]
            path = words[0]
            if "*" in path:
                continue
            rows.append((method, re.sub(r"\{[^}]+\}", "x", path), cells[1]))
    return rows


ROWS = endpoint_rows()


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    # the LoRA routes as with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (the table's "served")
    app = create_app(model.batcher(), "endpoints-test", model.byte_tokenizer(),
                     lora_updates=True)
    with TestClient(app) as test_client:
        yield test_client


def test_the_table_lists_the_endpoints_the_brief_names() -> None:
    paths = {path for _, path, _ in ROWS}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/health",
            "/ping", "/metrics", "/tokenize", "/detokenize", "/version", "/tokenizer_info",
            "/v1/embeddings", "/pooling", "/score", "/rerank", "/v1/load_lora_adapter",
            "/sleep"} <= paths
    assert {state for _, _, state in ROWS} == {"served", "not served"}


@pytest.mark.parametrize(("method", "path", "state"), ROWS,
                         ids=[f"{m} {p} {s}" for m, p, s in ROWS])
def test_each_endpoint_is_served_as_the_table_says(client: TestClient, method: str, path: str,
                                                   state: str) -> None:
    response = client.request(method, path, json={}) if method == "POST" else client.get(path)
    error = response.json().get("error", {}) if response.status_code == 404 else {}
    # the router's 404 names no field; a routed one's (an unknown response id) names its param
    routed = not (error.get("code") == "not_found" and error.get("param") is None)
    assert routed == (state == "served"), (method, path, response.status_code, response.text)

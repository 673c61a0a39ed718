"""The HTTP server answers over-long, negative and missing fields with OpenAI error bodies that
name the field, and serves the context boundary and a huge seed."""

from __future__ import annotations

import pytest

from atombatch import Batcher


# -- HTTP edge cases --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def http_server():
    import httpx
    from support.serving import ART, NAME, WEIGHT_SEED, ServerThread

    from atombatch.runtime.numpy_runtime import NumpyRuntime
    from atombatch.serve import create_app

    app = create_app(Batcher(NumpyRuntime.random(ART, seed=WEIGHT_SEED), overlap=True), NAME)
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.mark.parametrize(("body", "status", "param", "code"), [
    ({"prompt": [5, 6], "max_tokens": 2**64 - 1}, 400, "prompt", "invalid_value"),
    ({"prompt": [5, 6], "max_tokens": 2**70}, 400, "prompt", "invalid_value"),
    ({"prompt": [5, 6], "max_tokens": -1}, 400, "max_tokens", "invalid_value"),
    ({"prompt": [5, 6], "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ({"max_tokens": 2}, 400, "prompt", "missing_required_parameter"),
    ({"prompt": [], "max_tokens": 2}, 400, "prompt", "invalid_value"),
    ({"prompt": "", "max_tokens": 2}, 400, "prompt", "invalid_value"),
    ({"prompt": [2**63], "max_tokens": 2}, 400, "prompt", "invalid_value"),
    ({"prompt": "<99999999999999999999999>", "max_tokens": 2}, 400, "prompt", "invalid_value"),
    ({"prompt": [5], "max_tokens": 2, "top_k": -2}, 400, "top_k", "invalid_value"),
    ({"prompt": [5], "max_tokens": 2, "stop_token_ids": [-1]}, 400, "stop_token_ids",
     "invalid_value"),
    ({"prompt": [5] * 128, "max_tokens": 1}, 400, "prompt", "invalid_value"),
    ({"messages": []}, 400, "messages", "invalid_value"),
    ({"messages": [{"role": "user", "content": "<5>" * 128}]}, 400, "messages",
     "invalid_value"),
])
def test_http_rejections_carry_openai_error_bodies(http_server, body, status, param, code):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = http_server.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == code and error["message"]


def test_http_context_boundary_and_huge_seed_are_served(http_server):
    response = http_server.post("/v1/completions", json={"prompt": [5] * 127, "max_tokens": 1,
                                                         "seed": 2**64 - 1, "temperature": 0})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage == {"prompt_tokens": 127, "completion_tokens": 1, "total_tokens": 128}
    response = http_server.post("/v1/completions", content=b'{"prompt": [5], "temperature": 1e999}',
                                headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "temperature"

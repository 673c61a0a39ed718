"""Chat templates: `atombatch.serve.chat_template` against transformers' `apply_chat_template`.

The templates below are written here in the styles of real model families (Llama 3 with tools
and a date from `strftime_now`, Qwen3 with tools, tool calls and thinking, Gemma3 with role
alternation checks and content parts, a retrieval template with documents, `{% break %}`,
`{% continue %}` and `{% generation %}`). Each checkpoint is written by transformers itself
(`save_pretrained`, so the files are where transformers 5 puts them: `chat_template.jinja`,
`additional_chat_templates/`), read back by both, and both must give the same text and ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.serving import NAME, ServerThread
from support.templates import GEMMA3, LLAMA3, QWEN3, save_checkpoint

from atombatch import ArtifactConfig, Batcher, ModelSpec
from atombatch.errors import ConfigError, RequestError
from atombatch.runtime.numpy_runtime import NumpyRuntime
from atombatch.serve import create_app
from atombatch.serve.chat_template import ChatTemplate, load_chat_template
from atombatch.serve.tokens import HFCodec

# assistant turns marked with {% generation %}, a dict() and a namespace counter.
RAG = (
    "{{ bos_token }}{% set ns = namespace(shown=0) %}{% if documents %}<documents>\n"
    "{% for doc in documents %}{% if ns.shown >= 3 %}{% break %}{% endif %}"
    "{% if not doc.text %}{% continue %}{% endif %}{% set ns.shown = ns.shown + 1 %}"
    "[{{ ns.shown }}] {{ doc.title }}: {{ doc.text }}\n"
    "{% endfor %}</documents>\n"
    '{% endif %}{% set names = dict(user="User", assistant="Chatbot", system="System") %}'
    "{% for message in messages %}{% if message.role == 'assistant' %}"
    "<|{{ names[message.role] }}|>{% generation %}{{ message.content }}{% endgeneration %}"
    "{{ eos_token }}\n"
    "{% else %}<|{{ names[message.role] }}|>{{ message.content }}\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|Chatbot|>{% endif %}")

STYLES = {  # template, bos, eos
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
    "qwen3": (QWEN3, None, "<|im_end|>"),
    "gemma3": (GEMMA3, "<bos>", "<eos>"),
    "rag": (RAG, "<bos>", "<eos>"),
}

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Seoul"}}}
CHATS: dict[str, list[tuple[list[dict[str, Any]], dict[str, Any]]]] = {
    "llama3": [
        ([{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Hi there"}],
         {}),
        ([{"role": "user", "content": "Weather in Seoul?"}], {"tools": TOOLS}),
        ([{"role": "user", "content": "Weather in Seoul?"},
          {"role": "assistant", "content": None, "tool_calls": [CALL]},
          {"role": "tool", "content": "31 C, humid", "tool_call_id": "call_1"}],
         {"tools": TOOLS}),
        ([{"role": "user", "content": "Hi"}], {"add_generation_prompt": False,
                                               "date_string": "01 Jan 2026"}),
        ([{"role": "user", "content": "Count to three"},
          {"role": "assistant", "content": "one, two,"}],
         {"add_generation_prompt": False, "continue_final_message": True}),
    ],
    "qwen3": [
        ([{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "2+2?"}],
         {}),
        ([{"role": "user", "content": "2+2?"}], {"enable_thinking": False}),
        ([{"role": "user", "content": "Weather in Seoul?"},
          {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
           "tool_calls": [CALL]},
          {"role": "tool", "content": "31 C"}, {"role": "tool", "content": "humid"}],
         {"tools": TOOLS}),
        ([{"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello!"},
          {"role": "user", "content": "Bye"}], {}),
    ],
    "gemma3": [
        ([{"role": "system", "content": "Answer in Korean."},
          {"role": "user", "content": [{"type": "text", "text": " Hello "},
                                       {"type": "text", "text": "world"}]},
          {"role": "assistant", "content": "Annyeong"}, {"role": "user", "content": "More"}],
         {}),
        ([{"role": "user", "content": "Hi"}], {"add_generation_prompt": False}),
    ],
    "rag": [
        ([{"role": "user", "content": "Summarize"}],
         {"documents": [{"title": "a", "text": "alpha"}, {"title": "empty", "text": ""},
                        {"title": "b", "text": "beta"}, {"title": "c", "text": "gamma"},
                        {"title": "d", "text": "delta"}]}),
        ([{"role": "system", "content": "Cite."}, {"role": "user", "content": "Q"},
          {"role": "assistant", "content": "A"}, {"role": "user", "content": "Q2"}], {}),
    ],
}


def hf_render(hf: Any, messages: list[dict[str, Any]], tokenize: bool,
              **kwargs: Any) -> Any:
    kwargs.setdefault("add_generation_prompt", True)
    out = hf.apply_chat_template(messages, tokenize=tokenize, **kwargs)
    if tokenize and not isinstance(out, list):
        out = out["input_ids"]
    return out


@pytest.mark.parametrize("style", sorted(STYLES))
def test_renders_like_transformers(tmp_path: Path, style: str) -> None:
    template, bos, eos = STYLES[style]
    hf = save_checkpoint(tmp_path, template, bos, eos)
    assert (tmp_path / "chat_template.jinja").is_file()  # where transformers 5 keeps it
    codec = HFCodec.from_dir(tmp_path)
    assert codec is not None and codec.chat_template is not None
    assert codec.chat_template_name == "chat_template.jinja"
    for messages, kwargs in CHATS[style]:
        want_text = hf_render(hf, messages, False, **kwargs)
        options = {"add_generation_prompt": True, **kwargs}
        assert codec.chat_template.render(messages, **options) == want_text, (messages, kwargs)
        assert codec.render_chat(messages, **options) == hf_render(hf, messages, True, **kwargs)


def test_named_templates_pick_tool_use_with_tools(tmp_path: Path) -> None:
    named = {"default": GEMMA3, "tool_use": QWEN3}
    hf = save_checkpoint(tmp_path, named, "<bos>", "<eos>")
    assert (tmp_path / "additional_chat_templates" / "tool_use.jinja").is_file()
    codec = HFCodec.from_dir(tmp_path)
    assert codec is not None and codec.chat_template is not None
    assert codec.chat_template_name == "chat_template.jinja [default, tool_use]"
    messages = [{"role": "user", "content": "Weather?"}]
    for kwargs in ({}, {"tools": TOOLS}):
        assert codec.chat_template.render(messages, **kwargs) == \
            hf_render(hf, messages, False, **kwargs)


def test_tokenizer_config_templates_string_and_named(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "default", "template": "D{{ messages[0].content }}"},
                           {"name": "rag", "template": "R"}], "bos_token": {"content": "<s>"}}))
    template = load_chat_template(tmp_path)
    assert template is not None and template.name == "tokenizer_config.json [default, rag]"
    assert template.render([{"role": "user", "content": "x"}]) == "Dx"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{{ bos_token }}{{ messages | length }}", "bos_token": "<s>"}))
    template = load_chat_template(tmp_path, {"bos_token": "<s>"})
    assert template is not None and template.name == "tokenizer_config.json"
    assert template.render([{"role": "user", "content": "x"}] * 2) == "<s>2"
    # chat_template.jinja wins over the config's entry, as in transformers
    (tmp_path / "chat_template.jinja").write_text("J")
    template = load_chat_template(tmp_path)
    assert template is not None and template.render([]) == "J"


def test_template_errors(tmp_path: Path) -> None:
    hf = save_checkpoint(tmp_path, GEMMA3, "<bos>", "<eos>")
    codec = HFCodec.from_dir(tmp_path)
    assert codec is not None and codec.chat_template is not None
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="Conversation roles must alternate"):
        hf_render(hf, bad, False)
    with pytest.raises(RequestError, match="^chat template: Conversation roles must alternate"):
        codec.chat_template.render(bad)
    with pytest.raises(RequestError, match="cannot both be true"):
        codec.chat_template.render(bad, continue_final_message=True)
    # The sandbox holds: no attribute escapes, no underscore names on a namespace.
    for text in ("{{ messages.__class__.__mro__ }}", "{% set ns = namespace(_x=1) %}",
                 "{{ 1 / 0 }}", "{{ messages[0].content.upper() }}"):
        with pytest.raises(RequestError, match="failed on these messages"):
            ChatTemplate({"default": text}, "t").render([])
    with pytest.raises(ConfigError, match=r"^chat template broken.jinja line 2: .*'endfor'"):
        ChatTemplate({"default": "{% for m in messages %}\n{{ m }}"}, "broken.jinja")
    with pytest.raises(ConfigError, match="include no 'default'"):
        ChatTemplate({"rag": "x"}, "tokenizer_config.json")


def test_server_prompt_is_the_transformers_prompt(tmp_path: Path) -> None:
    """The chat endpoint feeds the engine exactly the ids transformers renders (tools shown to
    the template with tool_choice "none", `chat_template_kwargs` passed through)."""
    hf = save_checkpoint(tmp_path, QWEN3, None, "<|im_end|>")
    codec = HFCodec.from_dir(tmp_path)
    spec = ModelSpec(name=NAME, family="llama", vocab_size=512, hidden_size=64,
                     intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, bos_token_id=1, eos_token_ids=(2,), dtype="float32")
    art = ArtifactConfig(model=spec, batch_size=2, max_seq_len=512, block_size=512,
                         num_blocks=3, prefill_chunk_size=64, kv_dtype="float32")
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Seoul?"}]
    with ServerThread(create_app(Batcher(NumpyRuntime.random(art, seed=3)), NAME, codec)) as s:
        card = httpx.get(f"{s.url}/v1/models").json()["data"][0]
        assert card["atombatch"]["chat_template"] == "chat_template.jinja"
        for extra, kwargs in (({}, {}),
                              ({"tools": TOOLS, "tool_choice": "none"}, {"tools": TOOLS}),
                              ({"chat_template_kwargs": {"enable_thinking": False}},
                               {"enable_thinking": False})):
            r = httpx.post(f"{s.url}/v1/chat/completions", timeout=60, json={
                "messages": messages, "max_tokens": 2, **extra})
            assert r.status_code == 200, r.text
            want = hf_render(hf, messages, True, **kwargs)
            assert r.json()["usage"]["prompt_tokens"] == len(want)
        r = httpx.post(f"{s.url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "developer", "content": "x"}], "max_tokens": 2,
            "continue_final_message": True, "add_generation_prompt": False})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_readme_text_chat_request_is_served(tmp_path: Path) -> None:
    """The README's text chat request, sent as written to a checkpoint with a tokenizer."""
    import re

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    body = json.loads(re.search(r"/v1/chat/completions .*?-d '(\{.*?\})'", readme,
                                flags=re.S).group(1))
    save_checkpoint(tmp_path, QWEN3, None, "<|im_end|>")
    spec = ModelSpec(name=NAME, family="qwen3", vocab_size=512, hidden_size=64,
                     intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, bos_token_id=1, eos_token_ids=(2,), dtype="float32")
    art = ArtifactConfig(model=spec, batch_size=1, max_seq_len=256, block_size=256,
                         num_blocks=2, prefill_chunk_size=64, kv_dtype="float32")
    app = create_app(Batcher(NumpyRuntime.random(art, seed=3)), NAME, HFCodec.from_dir(tmp_path))
    with ServerThread(app) as s:
        r = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert "x-ignored-fields" not in r.headers
    answer = r.json()
    assert answer["usage"]["completion_tokens"] == len(answer["choices"][0]["token_ids"]) > 0
    assert isinstance(answer["choices"][0]["message"]["content"], str)

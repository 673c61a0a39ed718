"""Chat templates rendered the way Hugging Face transformers' `apply_chat_template` renders them.

Where a checkpoint keeps its template (the order transformers reads them in):
1. `chat_template.jinja` (transformers 5 writes the default template there) and
   `additional_chat_templates/<name>.jinja` (further named templates);
2. otherwise `tokenizer_config.json` `chat_template`: a string, or a list of `{"name", "template"}`;
3. otherwise `chat_template.json` `{"chat_template": ...}` (the processor format).
With several named templates, `tool_use` is used when the request carries tools and it exists,
`default` otherwise.

Rendering matches transformers: a sandboxed jinja2 environment (`ImmutableSandboxedEnvironment`,
`trim_blocks`, `lstrip_blocks`) with the loop-controls extension (`{% break %}`,
`{% continue %}`) and the `{% generation %}` tag, the `tojson` filter without HTML escaping (with
`indent`, `separators`, `sort_keys`, `ensure_ascii`), and the globals `raise_exception`,
`strftime_now`, `dict` and `namespace`. Messages lose their `None`-valued keys, and an earlier
assistant reasoning is visible as `reasoning_content` and `thinking`. The template sees
`messages`, `tools`, `documents`, `add_generation_prompt`, the tokenizer's named special tokens
(`bos_token`, `eos_token`, ...) and any extra keyword (a request's `chat_template_kwargs`, e.g.
`enable_thinking`).

A template that does not compile is a `ConfigError` naming the file and line (the server exits
at startup); a template that fails on a request's messages (`raise_exception`, a type error) is
a `RequestError` for that request alone.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from atombatch.errors import ConfigError, RequestError

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
# What a request's chat_template_kwargs may not set: the renderer's own arguments and the
# tokenizer's special tokens (a client-chosen `eos_token` printed after every message multiplies
# the prompt; vLLM refuses these too).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "self", "messages", "conversation", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "chat_template", "tokenize", "max_chars", "kwargs",
    *SPECIAL_TOKEN_NAMES, "additional_special_tokens"})
_REASONING = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "ATOMBATCH_CONTINUE_FINAL_MESSAGE "


class ChatTemplate:
    """One checkpoint's compiled chat template(s).

    Args:
        templates: template source by name (`default`, `tool_use`, ...); a single template is
            `{"default": source}`.
        source: where they came from, as shown at startup and in `/v1/models`.
        special_tokens: the tokenizer's named special tokens, passed to the template.

    Raises:
        ConfigError: a template does not compile, jinja2 is missing, or there is no `default`.
    """

    def __init__(self, templates: Mapping[str, str], source: str,
                 special_tokens: Mapping[str, str] | None = None) -> None:
        if "default" not in templates:
            raise ConfigError(f"chat template {source}: named templates "
                              f"{', '.join(sorted(templates))} include no 'default'")
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        env = _environment()
        from jinja2 import TemplateSyntaxError
        self._compiled: dict[str, Any] = {}
        for name, text in templates.items():
            where = source if len(templates) == 1 else f"{source} [{name}]"
            if not isinstance(text, str):
                raise ConfigError(f"chat template {where}: expected a string, got "
                                  f"{type(text).__name__}")
            try:
                self._compiled[name] = env.from_string(text)
            except TemplateSyntaxError as exc:
                raise ConfigError(f"chat template {where} line {exc.lineno}: {exc.message}") \
                    from None
        self.sources = dict(templates)

    @property
    def name(self) -> str:
        """`chat_template.jinja`, or `tokenizer_config.json [default, tool_use]` when named."""
        if len(self._compiled) == 1:
            return self.source
        return f"{self.source} [{', '.join(sorted(self._compiled))}]"

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               tools: Sequence[Mapping[str, Any]] | None = None,
               documents: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               max_chars: int | None = None, **kwargs: Any) -> str:
        """The prompt text for `messages` (what `apply_chat_template(..., tokenize=False)` gives).

        Raises:
            RequestError: the template raised (`raise_exception`) or failed on these inputs, its
                output passed `max_chars` (rendering stops there), or `continue_final_message`
                cannot be honoured.
        """
        check_template_kwargs(kwargs)
        if continue_final_message and add_generation_prompt:
            raise RequestError("continue_final_message and add_generation_prompt cannot both be "
                               "true: continuing the last message adds no new assistant header")
        chat = [_normalize(m) for m in messages]
        final = None
        if continue_final_message:
            if not chat or not isinstance(chat[-1].get("content"), str):
                raise RequestError("continue_final_message needs a last message with text content")
            final = chat[-1]["content"]
            chat[-1]["content"] = final + _CONTINUE_TAG
        template = self._compiled.get("tool_use") if tools is not None else None
        template = template or self._compiled["default"]
        context = {**self.special_tokens, **kwargs, "messages": chat,
                   "tools": _plain(list(tools)) if tools is not None else None,
                   "documents": _plain(list(documents)) if documents is not None else None,
                   "add_generation_prompt": add_generation_prompt}
        try:
            text = _rendered(template, context, max_chars)
        except RequestError:
            raise
        except _TemplateRaised as exc:
            raise RequestError(f"chat template: {exc.message}") from None
        except Exception as exc:  # any failure of an untrusted template fails this request only
            raise RequestError(f"chat template {self.source} failed on these messages: "
                               f"{type(exc).__name__}: {exc}") from None
        if final is not None:
            at = text.rfind(_CONTINUE_TAG.strip())
            if at < 0 or final.strip() not in text:
                raise RequestError("continue_final_message: the chat template does not keep the "
                                   "final message's text, so it cannot be continued")
            text = text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()
        return text


def check_template_kwargs(kwargs: Mapping[str, Any]) -> None:
    """Refuse template keywords that would override the renderer's arguments or the tokenizer's
    special tokens (`RESERVED_TEMPLATE_KWARGS`).

    Raises:
        RequestError: naming the keyword (param `chat_template_kwargs`).
    """
    taken = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if taken:
        raise RequestError(f"chat_template_kwargs may not set {', '.join(taken)}: the server "
                           "sets the template's messages, tools, documents, generation flags and "
                           "the tokenizer's special tokens itself", param="chat_template_kwargs")


def _rendered(template: Any, context: dict[str, Any], max_chars: int | None) -> str:
    """The template's output, built piece by piece and stopped once it passes `max_chars`."""
    if max_chars is None:
        return str(template.render(**context))
    pieces: list[str] = []
    size = 0
    for piece in template.generate(**context):
        size += len(piece)
        if size > max_chars:
            raise RequestError(f"the chat template's output passed max_prompt_chars="
                               f"{max_chars} characters (more than the context can hold)",
                               param="messages", limit=max_chars)
        pieces.append(piece)
    return "".join(pieces)


def load_chat_template(path: str | Path, special_tokens: Mapping[str, str] | None = None
                       ) -> ChatTemplate | None:
    """The chat template a checkpoint (or tokenizer) directory carries; None when it has none.

    Raises:
        ConfigError: a template file cannot be read or does not compile.
    """
    path = Path(path)
    templates: dict[str, str] = {}
    source = ""
    jinja_file = path / "chat_template.jinja"
    extra_dir = path / "additional_chat_templates"
    if jinja_file.is_file():
        templates["default"] = _read(jinja_file)
        source = "chat_template.jinja"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            templates[file.name.removesuffix(".jinja")] = _read(file)
        source = source or "additional_chat_templates/"
    if not templates:
        config = _read_json(path / "tokenizer_config.json")
        value = config.get("chat_template") if config else None
        if value is None:
            value = (_read_json(path / "chat_template.json") or {}).get("chat_template")
            source = "chat_template.json"
        else:
            source = "tokenizer_config.json"
        if isinstance(value, str):
            templates["default"] = value
        elif isinstance(value, list):
            for entry in value:
                if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                    raise ConfigError(f"chat template {path / source}: a named template must be "
                                      '{"name": ..., "template": ...}')
                templates[entry["name"]] = entry.get("template")  # type: ignore[assignment]
        elif value is not None:
            raise ConfigError(f"chat template {path / source}: expected a string or a list of "
                              f"named templates, got {type(value).__name__}")
    if not templates:
        return None
    return ChatTemplate(templates, source, special_tokens)


def template_from_argument(value: str, special_tokens: Mapping[str, str] | None = None
                           ) -> ChatTemplate:
    """`--chat-template`: a file holding the template, or the template text itself (as vLLM).

    Raises:
        ConfigError: the file cannot be read or the template does not compile.
    """
    file = Path(value)
    looks_like_path = not any(c in value for c in "{}\n") and len(value) < 4096
    if looks_like_path:
        if not file.is_file():
            raise ConfigError(f"--chat-template {value}: no such file (give a file or the "
                              "template text itself)")
        return ChatTemplate({"default": _read(file)}, str(file), special_tokens)
    return ChatTemplate({"default": value}, "--chat-template (inline)", special_tokens)


def special_tokens_of(path: str | Path) -> dict[str, str]:
    """The named special tokens (`bos_token`, ...) of `tokenizer_config.json` and
    `special_tokens_map.json`, as strings (an AddedToken object gives its `content`)."""
    path = Path(path)
    tokens: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        config = _read_json(path / name) or {}
        for key in SPECIAL_TOKEN_NAMES:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                tokens[key] = value
    return tokens


# -- the environment -------------------------------------------------------------------------------
class _TemplateRaised(Exception):
    """`raise_exception(message)` inside a template."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _environment() -> Any:
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover - jinja2 ships with the server extra
        raise ConfigError("rendering a chat template needs jinja2 (pip install "
                          "'atombatch[server]')") from None

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (transformers marks the
        assistant's tokens with it for training masks; serving only needs the text)."""

        tags = {"generation"}  # noqa: RUF012 (jinja's own class attribute)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body) \
                .set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return str(caller())

    class Namespace(jinja2.utils.Namespace):
        """`namespace(...)` that refuses underscore-prefixed attributes."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                _check_attribute(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            _check_attribute(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = Namespace
    return env


def _check_attribute(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        from jinja2.exceptions import SecurityError
        raise SecurityError(f"a chat template may not set the attribute {name!r} on a namespace")


class _TemplateDict:
    """`dict(...)` in a template builds a plain dict and exposes nothing else of the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _normalize(message: Mapping[str, Any]) -> dict[str, Any]:
    """Drop None-valued keys; show an assistant's reasoning under every name templates read."""
    out = {k: _plain(v) for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in _REASONING if out.get(k) is not None), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _plain(value: Any) -> Any:
    """JSON data as plain dicts, lists and scalars (nothing else reaches the sandbox)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(value)


def _read(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the chat template {file}: {exc}") from None


def read_json(file: Path) -> dict[str, Any] | None:
    """A JSON object file; None when absent or not an object (ConfigError when unreadable)."""
    return _read_json(file)


def _read_json(file: Path) -> dict[str, Any] | None:
    if not file.is_file():
        return None
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {file}: {exc}") from None
    return value if isinstance(value, dict) else None

"""LoRA adapters on the server, as vLLM serves them (docs/lora.md#serving-adapters).

- `--lora-modules`: vLLM's two spellings, `name=path` and the JSON object `{"name": ...,
  "path": ..., "base_model_name": ...}` (`LoraModulesAction`), into `LoraModule`s;
- `runtime_updates_allowed`: vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING` ("1" or "true", any case):
  without it `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` are not routed (404);
- the load and unload bodies (`LoadLoraAdapterRequest`, `UnloadLoraAdapterRequest`), bounded
  before they are decoded;
- `check_static_modules`: `--lora-modules` against what the runtime can serve (a loadable
  runtime loads them; a compiled artifact must hold every name: the message lists what it holds).

The adapters themselves (their weights, ids and identities) are the engine's: the front reads
the served names from `AsyncBatcher.lora_adapters` / `CoreClient.lora_adapters`, the same on
every front of a shared core (docs/lora.md).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from atombatch.errors import ConfigError

ENV_RUNTIME_UPDATES = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
# vLLM's MaxLoRARanks (vllm/config/lora.py): the values --max-lora-rank takes
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DEFAULT_MAX_LORA_RANK = 16   # vLLM's default
DEFAULT_MAX_LORAS = 1        # vLLM's default: adapters in one step
# adapters loaded at once (each holds its matrices in host memory) when --max-cpu-loras is not
# given: a client that may load adapters cannot fill the host's memory
DEFAULT_MAX_CPU_LORAS = 16
MAX_NAME_CHARS = 256         # an adapter name (it becomes a `model` id and a metric label)
MAX_PATH_CHARS = 4096        # PATH_MAX
MAX_BODY_BYTES = 16 * 1024   # a load or unload body: two short strings and two flags


class LoraModule(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One `--lora-modules` entry (vLLM's `LoRAModulePath`)."""

    name: str
    path: str
    base_model_name: str | None = None
    is_3d_lora_weight: bool = False   # vLLM's MoE layout switch: no MoE models here (ignored)


class LoadLoraAdapterRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """`POST /v1/load_lora_adapter` (vLLM's `LoadLoRAAdapterRequest`)."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False
    is_3d_lora_weight: bool = False


class UnloadLoraAdapterRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """`POST /v1/unload_lora_adapter` (vLLM's `UnloadLoRAAdapterRequest`)."""

    lora_name: str
    lora_int_id: int | None = None


def runtime_updates_allowed(environ: Mapping[str, str] = os.environ) -> bool:
    """vLLM's reading of `VLLM_ALLOW_RUNTIME_LORA_UPDATING`: "1" or "true", any case, spaces
    around ignored."""
    return environ.get(ENV_RUNTIME_UPDATES, "0").strip().lower() in ("1", "true")


def parse_module(item: str) -> LoraModule:
    """One `--lora-modules` word, as vLLM reads it: `name=path` when it has a `=` and no `,`,
    else a JSON object with `name`, `path` and optionally `base_model_name`.

    Raises:
        ValueError: the word is neither, naming it and the rule.
    """
    if "=" in item and "," not in item:
        name, path = item.split("=", 1)
        module = LoraModule(name=name, path=path)
    else:
        try:
            raw = json.loads(item)
        except json.JSONDecodeError:
            raise ValueError(f"Invalid JSON format for --lora-modules: {item}") from None
        try:
            module = msgspec.convert(raw, LoraModule)
        except msgspec.ValidationError as exc:
            raise ValueError(f"Invalid fields for --lora-modules: {item} - {exc}") from None
    check_name(module.name, "--lora-modules name")
    if not module.path:
        raise ValueError(f"--lora-modules {item}: the path is empty (name=path)")
    return module


class LoraModulesAction(argparse.Action):
    """argparse action of `--lora-modules` (vLLM's `LoRAParserAction`): empty words are
    skipped; a word that parses as neither spelling exits 2 naming it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        words = [values] if isinstance(values, str) else list(values or ())
        modules: list[LoraModule] = []
        for item in words:
            if not item:
                continue
            try:
                modules.append(parse_module(item))
            except ValueError as exc:
                parser.error(str(exc))
        setattr(namespace, self.dest, modules)


def check_name(name: str, what: str) -> None:
    """An adapter name is a non-empty string of at most `MAX_NAME_CHARS` printable characters.

    Raises:
        ValueError: naming the value and the rule.
    """
    if not name:
        raise ValueError(f"{what} is empty: an adapter needs a name")
    if len(name) > MAX_NAME_CHARS:
        raise ValueError(f"{what} {name[:40]!r}... has {len(name)} characters, more than "
                         f"{MAX_NAME_CHARS}")
    if not name.isprintable():
        raise ValueError(f"{what} {name[:40]!r} has unprintable characters")


def check_lora_flags(args: argparse.Namespace, served_name: str | None = None) -> None:
    """The LoRA flags' own rules, before anything loads.

    Raises:
        ConfigError: `--lora-modules` without `--enable-lora` on a runtime that loads adapters
            (a compiled artifact serves its adapters without the flag), a name given twice or
            the served model's, `--max-loras` below 1, `--max-cpu-loras` below it.
    """
    modules: Sequence[LoraModule] = getattr(args, "lora_modules", None) or ()
    if args.max_loras is not None and args.max_loras < 1:
        raise ConfigError(f"--max-loras {args.max_loras} must be >= 1")
    cpu = getattr(args, "max_cpu_loras", None)
    if cpu is not None and args.max_loras is not None and cpu < args.max_loras:
        raise ConfigError(f"--max-cpu-loras {cpu} must be >= --max-loras {args.max_loras} "
                          "(as vLLM)")
    if args.runtime in ("sim", "null") and (args.enable_lora or modules):
        raise ConfigError(f"--{'lora-modules' if modules else 'enable-lora'}: the "
                          f"{args.runtime} runtime loads no adapters (the numpy runtime loads "
                          "PEFT adapters; --runtime rebel serves the compiled ones)")
    if modules and args.runtime != "rebel" and not args.enable_lora:
        raise ConfigError(f"--lora-modules {modules[0].name}=...: LoRA is off; add --enable-lora "
                          "(as vLLM)")
    seen: set[str] = set()
    for module in modules:
        if module.name in seen:
            raise ConfigError(f"--lora-modules names the adapter {module.name!r} twice")
        if served_name is not None and module.name == served_name:
            raise ConfigError(f"--lora-modules {module.name}: the name is the served model's "
                              "(--served-model-name); an adapter needs its own")
        seen.add(module.name)


def app_options(args: argparse.Namespace) -> dict[str, Any]:
    """The LoRA keywords of `create_app` from the server's flags: what the plain server
    (`atombatch.serve`) and a Ray replica (`atombatch.serve.ray`) both pass, so both serve
    adapters alike (`/v1/models`, `/v1/load_lora_adapter`, `--max-loras`). A compiled artifact's
    adapters are not paths to load (`--runtime rebel`: no `lora_paths`)."""
    modules: Sequence[LoraModule] = getattr(args, "lora_modules", None) or ()
    return {"enable_lora": bool(getattr(args, "enable_lora", False)),
            "max_loras": args.max_loras, "max_cpu_loras": getattr(args, "max_cpu_loras", None),
            "lora_paths": {m.name: m.path for m in modules if args.runtime != "rebel"}}


def check_compiled(modules: Sequence[LoraModule], compiled: Mapping[str, Any],
                   model: str) -> None:
    """`--lora-modules` against a compiled artifact's adapters (`RebelRuntime.lora_adapters`):
    every name must be one it holds (the path is not read: the weights are compiled in).

    Raises:
        ConfigError: a name the artifact does not hold, listing the ones it does.
    """
    for module in modules:
        if module.name not in compiled:
            held = ", ".join(sorted(compiled)) or "none"
            raise ConfigError(f"--lora-modules {module.name}: the compiled directory {model} "
                              f"holds no adapter of that name (it holds: {held}); compiled "
                              "adapters are served under their lora_name (docs/lora.md)")


def decode_load(body: bytes) -> LoadLoraAdapterRequest:
    """A load body, bounded before it is parsed.

    Raises:
        ValueError: too large, not JSON, wrong types, an empty or too long name or path.
    """
    value = _decode(body, LoadLoraAdapterRequest)
    if not value.lora_name or not value.lora_path:
        raise ValueError("Both 'lora_name' and 'lora_path' must be provided.")
    check_name(value.lora_name, "lora_name")
    if len(value.lora_path) > MAX_PATH_CHARS or "\x00" in value.lora_path:
        raise ValueError(f"lora_path of {len(value.lora_path)} characters is not a path "
                         f"(at most {MAX_PATH_CHARS}, no NUL)")
    return value


def decode_unload(body: bytes) -> UnloadLoraAdapterRequest:
    """An unload body, bounded before it is parsed.

    Raises:
        ValueError: too large, not JSON, wrong types, no name.
    """
    value = _decode(body, UnloadLoraAdapterRequest)
    if not value.lora_name:
        raise ValueError("'lora_name' needs to be provided to unload a LoRA adapter.")
    check_name(value.lora_name, "lora_name")
    return value


def _decode(body: bytes, kind: type[Any]) -> Any:
    if len(body) > MAX_BODY_BYTES:
        raise ValueError(f"body of {len(body)} bytes: a LoRA adapter request takes at most "
                         f"{MAX_BODY_BYTES}")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"body is not valid JSON: {exc}") from None

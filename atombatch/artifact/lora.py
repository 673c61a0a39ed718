"""LoRA adapters: PEFT directories read into float32 A/B matrices, with every bound checked.

A PEFT LoRA adapter is a directory holding `adapter_config.json` (rank `r`, `lora_alpha`,
`target_modules`, `bias`, `use_rslora`, ...) and `adapter_model.safetensors`, whose tensors are
named `base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight` ([r, in]) and
`...lora_B.weight` ([out, r]). A target linear layer then computes `W x + scaling * B (A x)`,
with `scaling = lora_alpha / r` (PEFT; `lora_alpha / sqrt(r)` with rank-stabilized LoRA) times
optimum-rbln's `scaling_factor` (1.0 when unset).

`load_peft` reads such a directory without torch: the config with msgspec, the weights with the
`safetensors` NumPy API (BF16 widened exactly). Every size a file claims is bounded before it is
read, and every rule broken is a `ConfigError` naming the value and the rule. Id 0
(`BASE_LORA_ID`) is the base model, as in optimum-rbln's `lora_config`; adapters are 1..N.

An adapter's `identity` is a digest of its resolved config and of its weight bytes: two adapters
with the same identity compute the same thing, which is what the prefix cache's block digests and
the PD header use to tell adapters apart.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

import msgspec
import numpy as np
import numpy.typing as npt

from atombatch.artifact.config import ModelSpec
from atombatch.errors import ConfigError

BASE_LORA_ID = 0                  # lora_int_ids entry of a row that runs the base model
MAX_LORA_RANK = 512               # the largest rank accepted when no max_lora_rank is given
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20        # an adapter_config.json is a few hundred bytes
MAX_HEADER_BYTES = 1 << 24        # a safetensors JSON header (16 MiB: thousands of tensors)

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES   # every linear layer of Llama, Qwen3, Gemma3

# Prefixes PEFT puts before `layers.{i}.`: a causal LM's and Gemma3's multimodal wrapper's.
_LAYER_PREFIXES = ("base_model.model.model.language_model.layers.",
                   "base_model.model.language_model.model.layers.",
                   "base_model.model.model.layers.")
_SAFETENSORS_FLOATS = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "BF16": "<u2"}
_DTYPE_SIZES = {"F32": 4, "F16": 2, "F64": 8, "BF16": 2}


class LoraAdapter(msgspec.Struct, frozen=True):
    """One LoRA adapter as the engine and the runtimes know it (the weights live apart)."""

    name: str                                  # the name requests use (vLLM's `lora_name`)
    lora_int_id: int                           # 1..N; 0 is the base model (BASE_LORA_ID)
    path: str                                  # the PEFT directory it was read from
    r: int                                     # rank: A is [r, in], B is [out, r]
    lora_alpha: float
    target_modules: tuple[str, ...]            # names from TARGET_MODULES, in that order
    use_rslora: bool = False                   # scaling lora_alpha / sqrt(r) instead of / r
    scaling_factor: float | None = None        # optimum-rbln's extra factor (None = 1.0)
    identity: str = ""                         # hex digest of the resolved config + weight bytes

    def __post_init__(self) -> None:
        # An adapter described without its weights (the simulator's, an embedder's) gets an
        # identity of its whole description, name and path included: "" is the base model's
        # (its cache root, its PD header), which an adapter must never pass for.
        if not self.identity:
            fields = {f: getattr(self, f) for f in self.__struct_fields__ if f != "identity"}
            digest = hashlib.sha256(b"atombatch-lora-described\0" +
                                    json.dumps(fields, sort_keys=True).encode()).hexdigest()
            msgspec.structs.force_setattr(self, "identity", digest)

    @property
    def scaling(self) -> float:
        """The factor of `B @ A`: PEFT's lora_alpha / r (or / sqrt(r) with rsLoRA), times
        `scaling_factor`."""
        base = self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)
        return base * (1.0 if self.scaling_factor is None else self.scaling_factor)


class LoraWeights:
    """An adapter's A [r, in] and B [out, r] float32 matrices per (layer index, module name).

    `pairs` holds every (layer, module) the adapter changes; a target module missing for a layer
    (PEFT's `layers_to_transform`) is simply absent and runs the base weights there.
    """

    __slots__ = ("pairs", "r")

    def __init__(self, r: int, pairs: dict[tuple[int, str], tuple[npt.NDArray[np.float32],
                                                                  npt.NDArray[np.float32]]]
                 ) -> None:
        self.r = r
        self.pairs = pairs

    def get(self, layer: int, module: str
            ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]] | None:
        """(A, B) of one linear layer, or None where the adapter leaves it alone."""
        return self.pairs.get((layer, module))

    @property
    def nbytes(self) -> int:
        """Bytes of every A and B matrix (what a device streams to apply the adapter)."""
        return sum(a.nbytes + b.nbytes for a, b in self.pairs.values())

    @property
    def flops_per_token(self) -> int:
        """Multiply-adds x 2 of the adapter's deltas for one token: r * (in + out) per pair."""
        return sum(2 * a.size + 2 * b.size for a, b in self.pairs.values())


def module_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target module of `spec`'s decoder layers."""
    hidden, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q_dim, kv_dim = spec.num_heads * d, spec.num_kv_heads * d
    return {"q_proj": (hidden, q_dim), "k_proj": (hidden, kv_dim), "v_proj": (hidden, kv_dim),
            "o_proj": (q_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


class _PeftConfig(msgspec.Struct, frozen=True):
    """The adapter_config.json fields LoRA math depends on (others are ignored)."""

    r: int = 8
    lora_alpha: float = 8.0
    target_modules: list[str] | str | None = None
    bias: str = "none"
    use_rslora: bool = False
    use_dora: bool = False
    peft_type: str = "LORA"
    rank_pattern: dict[str, Any] = {}
    alpha_pattern: dict[str, Any] = {}
    modules_to_save: list[str] | None = None
    fan_in_fan_out: bool = False


def _where(path: Path) -> str:
    return f"LoRA adapter {str(path)!r}"


def _open_regular(path: Path, limit: int, where: str, missing: str, holder: str
                  ) -> tuple[BinaryIO, int]:
    """`path` opened for reading, and its size: a regular file (symlinks followed, as in a
    Hugging Face cache) of at most `limit` bytes, both checked on the opened descriptor before
    anything is read, so a FIFO or a device (/dev/zero) cannot hang the reader or feed it
    without end, and a file swapped after the check is not the one read. Every byte parsed, and
    hashed into the adapter's identity, comes from this one descriptor."""
    try:
        # O_NONBLOCK: opening a FIFO with no writer would block; a regular file ignores it
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"{where} has no {path.name}: {missing}") from None
    except OSError as exc:
        raise ConfigError(f"{where}: {path.name} cannot be opened ({exc.strerror})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise ConfigError(f"{where}: {path.name} is not a regular file (a FIFO, device or "
                          "directory is never read)")
    if info.st_size > limit:
        os.close(fd)
        raise ConfigError(f"{where}: {path.name} is {info.st_size} bytes, more than the "
                          f"{limit} {holder}", limit=limit)
    return os.fdopen(fd, "rb", buffering=0), info.st_size


def _read_exact(f: BinaryIO, count: int, where: str, path: Path, last: bool = False
                ) -> bytearray:
    """`count` bytes of `f` (a file that shrank meanwhile is refused); with `last`, the file
    must end there (one that grew is refused)."""
    data = bytearray(count)
    view, got = memoryview(data), 0
    while got < count:
        n = f.readinto(view[got:got + (1 << 20)])  # type: ignore[attr-defined]
        if not n:
            break
        got += n
    if got != count or (last and f.read(1) != b""):
        raise ConfigError(f"{where}: {path.name} changed size while it was read")
    return data


def _read_config(directory: Path) -> _PeftConfig:
    path = directory / CONFIG_FILE
    f, size = _open_regular(path, MAX_CONFIG_BYTES, _where(directory),
                            f"a PEFT adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE}",
                            "an adapter config may have")
    with f:
        raw = _read_exact(f, size, _where(directory), path, last=True)
    try:
        return msgspec.json.decode(raw, type=_PeftConfig)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{_where(directory)}: {CONFIG_FILE} is not a PEFT LoRA config "
                          f"({exc})") from None


def _resolve_targets(config: _PeftConfig, directory: Path, family: str) -> tuple[str, ...]:
    targets = config.target_modules
    if targets == "all-linear":
        return TARGET_MODULES
    if not isinstance(targets, list) or not targets:
        raise ConfigError(f"{_where(directory)}: target_modules={targets!r} must be a list of "
                          f"module names (of {list(TARGET_MODULES)}) or 'all-linear'")
    names = []
    for raw in targets:
        name = raw.rsplit(".", 1)[-1]
        if name not in TARGET_MODULES:
            raise ConfigError(f"{_where(directory)}: target module {raw!r} is not a linear "
                              f"layer of a {family} decoder layer ({list(TARGET_MODULES)})")
        names.append(name)
    return tuple(m for m in TARGET_MODULES if m in names)


def _check_config(config: _PeftConfig, directory: Path, max_rank: int) -> None:
    where = _where(directory)
    if config.peft_type.upper() != "LORA":
        raise ConfigError(f"{where}: peft_type={config.peft_type!r}, only LORA adapters load")
    if not 1 <= config.r <= max_rank:
        raise ConfigError(f"{where}: r={config.r} is outside 1..max_lora_rank={max_rank}",
                          limit=max_rank)
    if not (math.isfinite(config.lora_alpha) and config.lora_alpha > 0):
        raise ConfigError(f"{where}: lora_alpha={config.lora_alpha} must be a positive number")
    if config.bias != "none":
        raise ConfigError(f"{where}: bias={config.bias!r}; only bias='none' adapters are "
                          "supported (as in optimum-rbln)")
    if config.use_dora:
        raise ConfigError(f"{where}: use_dora=True; DoRA adapters are not supported")
    if config.rank_pattern or config.alpha_pattern:
        raise ConfigError(f"{where}: rank_pattern/alpha_pattern give modules their own rank or "
                          "alpha; an adapter must have one r and one lora_alpha")
    if config.modules_to_save:
        raise ConfigError(f"{where}: modules_to_save={config.modules_to_save!r}; an adapter that "
                          "replaces whole modules is not supported")
    if config.fan_in_fan_out:
        raise ConfigError(f"{where}: fan_in_fan_out=True is for Conv1D (GPT-2) layers, not "
                          "these decoders")


def _parse_key(key: str) -> tuple[int, str, str] | None:
    """(layer, module, 'A' | 'B') of a PEFT LoRA tensor name, or None."""
    for prefix in _LAYER_PREFIXES:
        if key.startswith(prefix):
            rest = key[len(prefix):].split(".")
            break
    else:
        return None
    # {i}.{self_attn|mlp}.{module}.lora_{A|B}.weight
    if len(rest) != 5 or not (rest[0].isascii() and rest[0].isdigit()) or \
            len(rest[0]) > 9 or rest[4] != "weight" or \
            rest[3] not in ("lora_A", "lora_B"):
        return None
    group = "self_attn" if rest[2] in ATTENTION_MODULES else "mlp"
    if rest[1] != group:
        return None
    return int(rest[0]), rest[2], rest[3][-1]


def _weights_bound(spec: ModelSpec, r: int, targets: tuple[str, ...]) -> int:
    shapes = module_shapes(spec)
    per_layer = sum(r * (shapes[m][0] + shapes[m][1]) for m in targets)
    return 8 + MAX_HEADER_BYTES + spec.num_layers * per_layer * max(_DTYPE_SIZES.values())


def _read_weights(directory: Path, spec: ModelSpec, r: int, targets: tuple[str, ...]
                  ) -> tuple[dict[tuple[int, str], tuple[npt.NDArray[np.float32],
                                                         npt.NDArray[np.float32]]], bytes]:
    where = _where(directory)
    path = directory / WEIGHTS_FILE
    bound = _weights_bound(spec, r, targets)
    f, size = _open_regular(path, bound, where, "adapter_model.bin is not read: convert it to "
                            "safetensors", f"an r={r} adapter of {list(targets)} on "
                            f"{spec.name} can need")
    with f:
        # the header first: every entry is checked before the tensors' bytes are read
        head = _read_exact(f, min(size, 8), where, path)
        header_len = int.from_bytes(head, "little") if size >= 8 else -1
        if not 0 < header_len <= min(MAX_HEADER_BYTES, size - 8):
            raise ConfigError(f"{where}: {WEIGHTS_FILE} has a header of {header_len} bytes, "
                              f"outside 1..{min(MAX_HEADER_BYTES, max(size - 8, 0))} (not a "
                              "safetensors file)")
        header_bytes = _read_exact(f, header_len, where, path)
        try:
            header = json.loads(header_bytes)
        except (ValueError, RecursionError):
            raise ConfigError(f"{where}: {WEIGHTS_FILE}'s header is not JSON") from None
        if not isinstance(header, dict):
            raise ConfigError(f"{where}: {WEIGHTS_FILE}'s header is not a JSON object")
        tensors = _check_header(header, where, spec, r, targets, size - 8 - header_len)
        body = _read_exact(f, size - 8 - header_len, where, path, last=True)
    digest = hashlib.sha256(head)
    digest.update(header_bytes)
    digest.update(body)
    found: dict[tuple[int, str], dict[str, npt.NDArray[np.float32]]] = {}
    for key, layer, module, which, dtype, begin, want in tensors:
        raw = np.frombuffer(body, dtype=_SAFETENSORS_FLOATS[dtype], count=math.prod(want),
                            offset=begin)
        if dtype == "BF16":
            value = (raw.astype(np.uint32) << np.uint32(16)).view(np.float32)
        else:
            value = raw.astype(np.float32)
        if not np.all(np.isfinite(value)):
            raise ConfigError(f"{where}: tensor {key!r} holds NaN or infinite values")
        found.setdefault((layer, module), {})[which] = value.reshape(want)
    pairs = {}
    for (layer, module), both in sorted(found.items()):
        if len(both) != 2:
            missing = "lora_B" if "A" in both else "lora_A"
            raise ConfigError(f"{where}: layer {layer}'s {module} has no {missing} matrix; "
                              "each adapted module needs both")
        pairs[(layer, module)] = (np.ascontiguousarray(both["A"]), np.ascontiguousarray(both["B"]))
    if not pairs:
        raise ConfigError(f"{where}: {WEIGHTS_FILE} holds no LoRA matrices")
    return pairs, digest.digest()


_Tensor = tuple[str, int, str, str, str, int, tuple[int, int]]


def _check_header(header: dict[str, Any], where: str, spec: ModelSpec, r: int,
                  targets: tuple[str, ...], body_size: int) -> list[_Tensor]:
    """Every tensor entry of a safetensors header checked (name, shape, dtype, byte range
    inside the body of `body_size` bytes): (key, layer, module, 'A' | 'B', dtype, begin, shape)."""
    tensors: list[_Tensor] = []
    shapes = module_shapes(spec)
    for key, info in header.items():
        if key == "__metadata__":
            continue
        parsed = _parse_key(key)
        if parsed is None:
            raise ConfigError(f"{where}: tensor {key!r} is not a LoRA A/B matrix of a decoder "
                              "layer's linear module")
        layer, module, which = parsed
        if module not in targets:
            raise ConfigError(f"{where}: tensor {key!r} changes {module}, which is not in "
                              f"target_modules={list(targets)}")
        if layer >= spec.num_layers:
            raise ConfigError(f"{where}: tensor {key!r} is for layer {layer}; {spec.name} has "
                              f"layers 0..{spec.num_layers - 1}")
        in_dim, out_dim = shapes[module]
        want = (r, in_dim) if which == "A" else (out_dim, r)
        shape = info.get("shape") if isinstance(info, dict) else None
        shape = tuple(shape) if isinstance(shape, list) else ()
        if shape != want:
            raise ConfigError(f"{where}: tensor {key!r} has shape {list(shape)}; r={r} on "
                              f"{spec.name}'s {module} needs {list(want)}")
        dtype = info["dtype"] if isinstance(info.get("dtype"), str) else None
        if dtype not in _SAFETENSORS_FLOATS:
            raise ConfigError(f"{where}: tensor {key!r} has dtype {dtype}, not one of "
                              f"{sorted(_SAFETENSORS_FLOATS)}")
        offsets = info.get("data_offsets")
        begin, end = offsets if isinstance(offsets, list) and len(offsets) == 2 and \
            all(type(o) is int for o in offsets) else (0, -1)
        count = math.prod(want)
        if end - begin != count * _DTYPE_SIZES[dtype] or begin < 0 or end > body_size:
            raise ConfigError(f"{where}: tensor {key!r}'s data_offsets {[begin, end]} do not hold "
                              f"{count} {dtype} values inside the file")
        tensors.append((key, layer, module, which, dtype, begin, want))
    return tensors


def load_peft(path: str | os.PathLike[str], *, name: str, lora_int_id: int, spec: ModelSpec,
              max_lora_rank: int | None = None, scaling_factor: float | None = None
              ) -> tuple[LoraAdapter, LoraWeights]:
    """Read a PEFT LoRA directory for `spec`'s decoder (no torch).

    Args:
        path: the directory holding adapter_config.json and adapter_model.safetensors.
        name: the adapter's name (what requests ask for).
        lora_int_id: its id, 1.. (0 is the base model).
        spec: the base model; every matrix's shape is checked against it.
        max_lora_rank: the largest rank accepted (None: MAX_LORA_RANK).
        scaling_factor: optimum-rbln's extra factor on the scaling (None = 1.0).
    Returns:
        The adapter's description (with its identity digest) and its float32 A/B matrices.
    Raises:
        ConfigError: a missing or oversized file, a rank above max_lora_rank, a target module
            the family does not have, bias other than "none", a matrix of the wrong shape, ...
    """
    directory = Path(path)
    if not name or len(name) > 256:
        raise ConfigError(f"LoRA adapter name {name!r} must have 1..256 characters")
    if isinstance(lora_int_id, bool) or not isinstance(lora_int_id, int) or lora_int_id < 1:
        raise ConfigError(f"lora_int_id={lora_int_id!r} for adapter {name!r} must be an integer "
                          f">= 1 ({BASE_LORA_ID} is the base model)")
    limit = MAX_LORA_RANK if max_lora_rank is None else max_lora_rank
    if not 1 <= limit <= MAX_LORA_RANK:
        raise ConfigError(f"max_lora_rank={max_lora_rank} is outside 1..{MAX_LORA_RANK}",
                          limit=MAX_LORA_RANK)
    if scaling_factor is not None and not math.isfinite(scaling_factor):
        raise ConfigError(f"scaling_factor={scaling_factor} of adapter {name!r} must be finite")
    if not directory.is_dir():
        raise ConfigError(f"{_where(directory)} is not a directory (a PEFT adapter directory "
                          f"holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    config = _read_config(directory)
    _check_config(config, directory, limit)
    targets = _resolve_targets(config, directory, spec.family)
    pairs, weights_digest = _read_weights(directory, spec, config.r, targets)
    resolved = {"r": config.r, "lora_alpha": float(config.lora_alpha),
                "target_modules": list(targets), "use_rslora": config.use_rslora,
                "scaling_factor": scaling_factor}
    identity = hashlib.sha256(json.dumps(resolved, sort_keys=True).encode() + b"\0" +
                              weights_digest).hexdigest()
    adapter = LoraAdapter(name=name, lora_int_id=lora_int_id, path=str(directory), r=config.r,
                          lora_alpha=float(config.lora_alpha), target_modules=targets,
                          use_rslora=config.use_rslora, scaling_factor=scaling_factor,
                          identity=identity)
    # the runtimes fold the scaling into B in float32: a scaling or a scaled B past float32's
    # range would be infinite there, and every row under the adapter NaN
    largest = max(float(np.abs(b).max()) for _, b in pairs.values())
    if not abs(adapter.scaling) * max(largest, 1.0) <= float(np.finfo(np.float32).max):
        raise ConfigError(f"{_where(directory)}: scaling {adapter.scaling:g} (lora_alpha="
                          f"{config.lora_alpha:g}, r={config.r}) times lora_B's largest value "
                          f"{largest:g} is past float32's range: the adapter would compute "
                          "infinities")
    return adapter, LoraWeights(config.r, pairs)

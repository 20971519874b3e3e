"""Read the few GGUF header fields the capacity model needs, without the weights.

gguf's ``GGUFReader`` decodes every metadata value, including the 262k-entry
vocabulary of the default model (seconds and hundreds of MB: docs/bench/figures.md
§node.capacity.gguf); this reader walks the header with gguf's own type tables and
keeps only the architecture's shape keys and the tensor sizes. A unit test checks it against
``GGUFReader`` on a small generated file.
"""

from __future__ import annotations

import importlib.util
import math
import mmap
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from broker.errors import ConfigError


def _gguf_constants() -> ModuleType:
    """gguf's ``constants`` module, without the rest of the package.

    ``import gguf`` runs the package's ``__init__``, which imports its reader,
    writer, quantizers and numpy: 0.3-0.4 s of every ``edgenode start`` (and of
    every command that plans capacity) for two tables (docs/bench/figures.md,
    "Start to ready"). ``gguf/constants.py`` imports only the standard library,
    so it is run alone, under a private name (its enums are then not gguf's own
    classes: this module only looks values up in them). A process that imported
    gguf already gets the package's module.

    Raises:
        ImportError: the gguf package is not installed.
    """
    loaded = sys.modules.get("gguf.constants")
    if loaded is not None:
        return loaded
    package = importlib.util.find_spec("gguf")  # locates it; imports nothing
    if package is None or not package.submodule_search_locations:
        raise ImportError("the gguf package is not installed")
    path = Path(next(iter(package.submodule_search_locations))) / "constants.py"
    spec = importlib.util.spec_from_file_location(f"{__name__}._gguf_constants", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_constants = _gguf_constants()
#: ggml type -> (block size in elements, bytes per block), as gguf's table.
GGML_QUANT_SIZES: dict[Any, tuple[int, int]] = _constants.GGML_QUANT_SIZES
#: ggml's tensor types (gguf ``GGMLQuantizationType``), an ``IntEnum``.
GGMLQuantizationType: Any = _constants.GGMLQuantizationType


@dataclass(frozen=True)
class ModelMeta:
    """What the plan needs from a GGUF file (lengths in elements, weights in bytes)."""

    path: str
    name: str
    n_layer: int
    n_head: int
    n_head_kv: tuple[int, ...]  # per layer; 0 = a layer without attention
    key_length: int
    value_length: int
    weights_bytes: int  # sum of the tensors' n_bytes
    n_vocab: int = 0  # entries of tokenizer.ggml.tokens; 0 = the file has no vocabulary


def read_gguf_meta(path: Path | str) -> ModelMeta:
    """Read a GGUF file's metadata and tensor table without touching the weights.

    A header walk (ggml docs/gguf.md) with the gguf package's tables, because
    ``gguf.GGUFReader`` decodes every vocabulary string into numpy arrays: 17 s
    and 740 MB RSS on the default model, against ~0.2 s and a few MB here.

    Raises:
        ConfigError: unreadable, not little-endian GGUF v2/v3, keys missing, or an
            architecture the formula does not cover (MLA, recurrent state).
    """
    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            kv, weights, lengths = _walk_gguf(buf)
        arch = kv["general.architecture"]
        if f"{arch}.attention.kv_lora_rank" in kv or f"{arch}.ssm.state_size" in kv:
            raise ConfigError(f"{path}: {arch} (MLA/recurrent) needs --weights and --kv-per-seq")
        n_layer, n_embd = int(kv[f"{arch}.block_count"]), int(kv[f"{arch}.embedding_length"])
        heads = _per_layer(kv[f"{arch}.attention.head_count"], n_layer)
        return ModelMeta(
            path=str(path),
            name=str(kv.get("general.name", Path(path).name)),
            n_layer=n_layer,
            n_head=heads[0],
            n_head_kv=_per_layer(kv.get(f"{arch}.attention.head_count_kv", list(heads)), n_layer),
            key_length=int(kv.get(f"{arch}.attention.key_length", n_embd // heads[0])),
            value_length=int(kv.get(f"{arch}.attention.value_length", n_embd // heads[0])),
            weights_bytes=weights,
            n_vocab=lengths.get("tokenizer.ggml.tokens", 0),
        )
    except (OSError, ValueError, KeyError, IndexError, ZeroDivisionError, struct.error) as exc:
        raise ConfigError(f"cannot read the GGUF metadata of {path}: {exc!r}") from exc


def _per_layer(value: Any, n_layer: int) -> tuple[int, ...]:
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),) * n_layer


#: GGUFValueType -> struct format; 8 = STRING, 9 = ARRAY.
_SCALAR = dict(zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd", strict=True))
_STRING, _ARRAY, _BIG_ARRAY = 8, 9, 4096  # longer arrays (the vocabulary) are not kept


def _walk_gguf(buf: mmap.mmap) -> tuple[dict[str, Any], int, dict[str, int]]:
    """(metadata, total tensor bytes, length of every array) of a GGUF v2/v3 file.

    Long arrays (the vocabulary) are skipped, not kept; their lengths are.
    """
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"not a little-endian GGUF v2/v3 file ({magic!r}, version {version})")
    pos, kv, weights, lengths = 24, {}, 0, {}
    for _ in range(n_kv):
        key, pos = _value(buf, pos, _STRING)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        if vtype == _ARRAY:
            (lengths[key],) = struct.unpack_from("<Q", buf, pos + 8)  # after the element type
        kv[key], pos = _value(buf, pos + 4, vtype)
    for _ in range(n_tensors):
        _, pos = _value(buf, pos, _STRING)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        *dims, ttype, _offset = struct.unpack_from(f"<{n_dims}QIQ", buf, pos + 4)
        pos += 4 + 8 * n_dims + 12
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        weights += math.prod(dims) // block * size
    return kv, weights, lengths


def _value(buf: mmap.mmap, pos: int, vtype: int) -> tuple[Any, int]:
    if vtype == _STRING:
        (n,) = struct.unpack_from("<Q", buf, pos)
        return buf[pos + 8 : pos + 8 + n].decode("utf-8", "replace"), pos + 8 + n
    if vtype != _ARRAY:
        fmt = "<" + _SCALAR[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    etype, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if etype in _SCALAR and count > _BIG_ARRAY:
        return None, pos + count * struct.calcsize("<" + _SCALAR[etype])
    items = []
    for _ in range(count):
        item, pos = _value(buf, pos, etype)
        if count <= _BIG_ARRAY:
            items.append(item)
    return (items if count <= _BIG_ARRAY else None), pos

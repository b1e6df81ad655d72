"""GGUF metadata (llama.cpp's format), torch-free: the tokenizer tier, the model config reader
and the worker's weight loader all read the same parsed file."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from services.common.errors import ModelLoadError


@functools.lru_cache(maxsize=4)
def open_gguf(path: Path) -> Any:
    """One parsed reader per file and process: parsing the metadata (49k token strings for
    SmolLM2) takes seconds, and the tokenizer and the config readers both need it."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises bare ValueErrors on bad magic/versions
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc


def field_value(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()

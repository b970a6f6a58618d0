"""The optional tokenizer of an export: ``tokenizer.json`` beside the graph, read with the ``tokenizers`` package.

Shared by ``qeff-kv generate`` (:mod:`qeff_kv.runtime.generate_job`) and ``qeff-kv serve``
(:mod:`qeff_kv.serve.server`), neither importing the other's job.
"""

from __future__ import annotations

from pathlib import Path

from qeff_kv.errors import MissingDependencyError, RuntimeInputError


def load_tokenizer(folder: Path, *, required: bool):
    """The ``tokenizers.Tokenizer`` of ``folder/tokenizer.json``, or ``None`` when not required and absent."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        if required:
            raise RuntimeInputError(
                f"--prompt needs a tokenizer, and {folder} has no tokenizer.json; give --prompt-ids instead")
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        if required:
            raise MissingDependencyError(
                "--prompt needs the 'tokenizers' package (pip install tokenizers); or give --prompt-ids") from None
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:
        raise RuntimeInputError(f"{path}: cannot be read as a tokenizer ({exc})") from None

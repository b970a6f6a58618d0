"""Typed errors of qeff-kv.

Every error the library raises on bad input derives from :class:`QeffKvError`. Its message is one line that
names what is wrong; the CLI prints ``error: <message>`` and exits with :attr:`QeffKvError.exit_code`.
"""

from __future__ import annotations


class QeffKvError(Exception):
    """Base class: a refusal with a one-line message."""

    exit_code = 2

    def __init__(self, message: str):
        # Keep messages on one line whatever the caller passed.
        super().__init__(" ".join(str(message).split()))


class PrefixError(QeffKvError, ValueError):
    """A KV-cache prefix is not a 1-64 character ASCII alphanumeric string."""


class GraphReadError(QeffKvError):
    """A file is missing, is not ONNX, or is truncated."""


class ContractError(QeffKvError):
    """A graph does not follow the retained-state KV contract (no KV buffers, unpaired, mixed prefixes...)."""


class RewriteError(QeffKvError):
    """A requested rewrite would break the graph (name collision, prefix caught by the substring regex...)."""


class DialectError(RewriteError):
    """A KV-dialect conversion (``rewrite --to``) that cannot be made exactly (a growing cache, a static cache whose
    update or head count cannot be read, a direction not built)."""


class PassInvariantError(QeffKvError):
    """A graph pass left the graph breaking the invariant its docstring states (a pass's ``ensures``): the graph is
    not used or written."""


class ExternalDataError(QeffKvError):
    """An external-data reference is unsafe (absolute, escapes the model folder) or cannot be followed."""


class ExportError(QeffKvError):
    """A model cannot be exported (unknown architecture, unsupported option, missing files...)."""


class CheckpointError(ExportError):
    """A checkpoint folder that transformers would not read as given: an index entry that is not a plain file name
    of the folder, a weights file that is not a regular file, a safetensors header that safetensors refuses, a
    tensor held by two files that no index decides between."""


class MissingDependencyError(QeffKvError):
    """An optional dependency (torch, transformers, tokenizers) is needed for this command."""


class UnsupportedVersionError(MissingDependencyError):
    """An installed dependency is outside the versions qeff-kv was tested on (transformers for export)."""


class RuntimeInputError(QeffKvError):
    """Bad input to the runtime: capacity exceeded, unknown sequence, bad token ids, bad options."""


class ProviderError(RuntimeInputError):
    """An onnxruntime execution provider (or ``device``) the runtime has not proved exact for the graph's kind
    (:mod:`qeff_kv.runtime.execution.ep_proofs`): refused before the graph is loaded."""


class RewindError(RuntimeInputError):
    """A rewind or copy that a sequence's memory cannot serve exactly (a recurrent state with no checkpoint at that
    position, a sliding-window ring that no longer holds the window): nothing was changed."""


class StateFileError(QeffKvError):
    """A KV state file is unreadable, truncated, edited, or belongs to another graph."""


class OutputError(QeffKvError, OSError):
    """An output path cannot be written: below an existing file, not a regular file, no permission, no space."""


class MemoryLimitError(QeffKvError):
    """A buffer would not fit in the memory available on this machine (refused before allocating it)."""


class VerificationError(ExportError):
    """An exported graph does not reproduce the model it came from (verification at export)."""


class VerificationMemoryError(ExportError, MemoryLimitError):
    """Verification on by default cannot fit in this machine's memory (refused up front, with the size needed)."""


class WholeModelMemoryError(ExportError, MemoryLimitError):
    """A model that cannot stream would be loaded whole, and that does not fit in this machine's memory (refused
    before any weight is read, with the size needed, why it did not stream and the way out)."""


class QueueFullError(QeffKvError):
    """The server's admission queue is full (HTTP 429): the request was not accepted; retry later."""


class Interrupted(QeffKvError):
    """A long-running command (``qeff-kv serve``) stopped on a signal after finishing what it could; the exit code
    is the shell's 128 + the signal (SIGTERM: 143)."""

    def __init__(self, message: str, exit_code: int = 143):
        super().__init__(message)
        self.exit_code = exit_code


class UnavailableError(QeffKvError):
    """The server cannot run requests now (every replica of a kind stopped, the engine closed): HTTP 503."""


class KVLoadError(QeffKvError):
    """A KV connector could not load a held state (timed out and freed, producer gone, never held): the consumer
    prefills the prompt itself, or answers 410 where the request asked to fail."""


class SidecarError(QeffKvError):
    """A runtime sidecar (``genai_config.json``, ``inference_metadata.yaml``) is unreadable, names a port the graph
    lacks, or pairs the graph's KV buffers differently than the graph does."""


class AdapterError(QeffKvError):
    """A LoRA adapter cannot be used: unreadable or unsupported PEFT folder (DoRA and other variants), a rank,
    module or base that does not fit the graph, an adapter name unknown to the session or server."""


class StateAdapterError(StateFileError, AdapterError):
    """A KV state computed with a LoRA adapter that this session does not hold (not loaded, or other weights under
    its name): a state error (a hand-off answers 400) and an adapter error."""

"""qeff-kv: retained-state KV-cache graphs for decoder LLMs.

Export (needs the ``[export]`` extra: torch, transformers), rewrite, check and run retained-state ONNX graphs.
Importing this package never imports torch.
"""

__version__ = "0.1.0"

from qeff_kv.contract import naming  # noqa: E402,F401
from qeff_kv.errors import QeffKvError  # noqa: E402,F401

"""Export a Hugging Face decoder to a retained-state ONNX graph (needs the ``[export]`` extra at call time).

Importing this package does not import torch; :func:`export_model` does, after validating its options.
"""

from qeff_kv.export.api import BUNDLED_NAME, MANIFEST_FILE, ExportResult, bundled_model_dir, export_model
from qeff_kv.export.options import ExportOptions

__all__ = ["export_model", "ExportResult", "ExportOptions", "bundled_model_dir", "BUNDLED_NAME", "MANIFEST_FILE"]

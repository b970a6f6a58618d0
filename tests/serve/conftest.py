"""Fixtures of the serve tests alone (tests/conftest.py holds the ones other folders share too)."""

from __future__ import annotations

from pathlib import Path

import pytest

from suite import HAS_TORCH


@pytest.fixture(scope="session")
def llava_cb_export(tmp_path_factory) -> Path:
    """The tiny seeded Llava of tests/helpers/hf_models.py with its working processor (one 32x32 image: 16 ``<image>``
    tokens), exported once per session for continuous batching (2 slots; ctx_len 64, prefill 8): what a server
    runs images on (tests/serve/test_serve_images.py)."""
    if not HAS_TORCH:
        pytest.skip("making the tiny Llava needs the [export] extra (torch, transformers)")
    from hf_models import add_llava_processor, make_llava_dir

    from qeff_kv.export import export_model

    model_dir = make_llava_dir(tmp_path_factory.mktemp("llava-cb-model"))
    add_llava_processor(model_dir)
    return export_model(model_dir, tmp_path_factory.mktemp("llava-cb") / "llava", ctx_len=64, prefill_seq_len=8,
                        continuous_batching=True, full_batch_size=2).out_dir

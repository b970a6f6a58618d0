"""Fixtures of the export tests alone (tests/conftest.py holds the ones other folders share too)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def family_refs(family_models):
    """transformers' greedy tokens for the matrix prompts."""
    from families import FAMILIES, NEW, PROMPTS
    from hf_models import hf_greedy, hf_greedy_whole

    cache: dict = {}

    def get(name: str) -> list[list[int]]:
        if name not in cache:
            greedy = hf_greedy_whole if FAMILIES[name].recurrent else hf_greedy
            cache[name] = [greedy(family_models(name), p, NEW) for p in PROMPTS]
        return cache[name]

    return get

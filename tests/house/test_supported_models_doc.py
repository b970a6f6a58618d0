"""docs/supported-models.md is generated from the family matrix and must be current."""

from gen_supported_models import DOC, render


def test_supported_models_page_matches_the_matrix():
    assert DOC.read_text() == render(), "run: python tests/helpers/gen_supported_models.py"

"""``generate --chat``: the chat template rendered without transformers, as transformers renders it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from suite import HAS_TORCH, REPO
from qeff_kv.errors import RuntimeInputError
from qeff_kv_cli.main import main

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
# Exercises what transformers' environment provides: special tokens as variables, raise_exception, loop
# controls, {% generation %}, tojson without HTML escaping, trim_blocks/lstrip_blocks.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}\n"
    "  {% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}\n"
    "  {% generation %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endgeneration %}\n"
    "  {% if loop.index >= 8 %}{% break %}{% endif %}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{{ {'note': 'é<&>'} | tojson }}{% endif %}"
)


def _folder(tmp_path: Path, *, template: str | None = TEMPLATE, jinja_file: bool = False) -> Path:
    """A fake export folder: a placeholder graph, a byte-level tokenizer with chat special tokens whose
    post-processor adds <s> (so adding special tokens or not is visible), tokenizer_config.json."""
    from tokenizers import Tokenizer, processors

    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "model.onnx").write_bytes(b"")  # --chat errors are raised before the graph is opened
    tok = Tokenizer.from_file(str(REPO / "fixtures" / "default-model" / "tokenizer.json"))
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
           "eos_token": "</s>",
           "pad_token": {"__type": "AddedToken", "content": "</s>", "special": True}}
    if template is not None and not jinja_file:
        cfg["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    if template is not None and jinja_file:
        (folder / "chat_template.jinja").write_text(template)
    return folder


def _ours(folder: Path, text: str, system: str | None = None) -> list[int]:
    from qeff_kv.runtime.text.chat import chat_prompt_ids, load_chat_template
    from qeff_kv.runtime.text.tokenizer import load_tokenizer

    return chat_prompt_ids(load_tokenizer(folder, required=True), load_chat_template(folder), text, system)


@pytest.mark.skipif(not HAS_TORCH, reason="needs transformers (the [export] extra) as the reference")
@pytest.mark.parametrize("jinja_file", [False, True])
def test_same_ids_as_transformers_apply_chat_template(tmp_path, jinja_file):
    import transformers

    folder = _folder(tmp_path, jinja_file=jinja_file)
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    for text, system in (("Hello there  ", None), ("Paris?", "Be brief.")):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        want = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        assert _ours(folder, text, system) == want


def test_rendered_text(tmp_path):
    from qeff_kv.runtime.text.chat import load_chat_template

    text = load_chat_template(_folder(tmp_path)).render([{"role": "user", "content": " hi "}])
    assert text == '<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n{"note": "é<&>"}'


def test_template_errors_are_one_line(tmp_path):
    from qeff_kv.runtime.text.chat import load_chat_template

    tmpl = load_chat_template(_folder(tmp_path))
    with pytest.raises(RuntimeInputError, match=r"chat template failed \(TemplateError: unknown role tool\)$"):
        tmpl.render([{"role": "tool", "content": "x"}])


def run(*args):
    return CliRunner().invoke(main, ["generate", *map(str, args)])


@pytest.mark.parametrize("args, message", [
    (["--chat", "--prompt-ids", "1,2"], "--chat formats --prompt text with the chat template; give --prompt TEXT"),
    (["--system", "x", "--prompt", "hi"], "--system is a chat turn; use it with --chat"),
])
def test_option_errors(tmp_path, args, message):
    r = run(_folder(tmp_path), *args)
    assert r.exit_code == 2 and r.output.strip() == f"error: {message}", r.output


def test_no_chat_template_is_one_line(tmp_path):
    folder = _folder(tmp_path, template=None)
    r = run(folder, "--chat", "--prompt", "hi")
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0] == (
        f"error: --chat needs a chat template, and {folder} has none (no chat_template.jinja, no 'chat_template' "
        f"in tokenizer_config.json); give the prompt as text instead"), r.output


def test_chat_on_the_bundled_export_needs_a_template(tmp_path):
    """The bundled default has a tokenizer but no chat template: --chat refuses before opening the graph."""
    folder = tmp_path / "bundled"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(REPO / "fixtures" / "default-model" / name, folder / name)
    (folder / "model.onnx").write_bytes(b"")
    r = run(folder, "--chat", "--prompt", "hi")
    assert r.exit_code == 2 and "--chat needs a chat template" in r.output

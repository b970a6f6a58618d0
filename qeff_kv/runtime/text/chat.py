"""Chat templates without transformers: render a model folder's Jinja2 chat template the way transformers does.

The template comes from ``chat_template.jinja`` or the ``chat_template`` key of ``tokenizer_config.json`` (a
string, or a list of ``{"name", "template"}`` of which ``default`` is used). Rendering follows transformers'
``apply_chat_template``: a sandboxed Jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``, the loop
controls extension, the globals ``raise_exception`` and ``strftime_now``, a ``tojson`` filter that does not
escape HTML, ``{% generation %}`` blocks rendered as their body; the variables ``messages``,
``add_generation_prompt`` and the special tokens (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``...)
of tokenizer_config.json / special_tokens_map.json. Rendering runs within a time and size budget
(:mod:`qeff_kv.runtime.text.template_budget`): a template that loops or builds a gigantic string is stopped with one line. The rendered text is tokenized without adding special
tokens (the template writes them), as transformers does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from qeff_kv.errors import MissingDependencyError, RuntimeInputError
from qeff_kv.runtime.text import template_budget

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):  # an AddedToken as JSON
        return value["content"]
    return None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RuntimeInputError(f"{path}: not valid JSON ({exc})") from None
    return data if isinstance(data, dict) else {}


@dataclass
class ChatTemplate:
    source: Path
    template: str
    special_tokens: dict[str, str] = field(default_factory=dict)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> str:
        """The prompt text for ``messages`` (``[{"role": ..., "content": ...}, ...]``); ``tools``: function tools
        (OpenAI's ``{"type": "function", "function": {...}}``) for templates that render them."""
        env = _environment()
        try:
            compiled = env.from_string(self.template)
            return template_budget.render(compiled, dict(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=tools, documents=None,
                **self.special_tokens))
        except template_budget.BudgetExceeded as exc:
            raise RuntimeInputError(f"{self.source}: the chat template was stopped: {exc}") from None
        except Exception as exc:  # jinja2.TemplateError and whatever the template raises
            text = str(exc).splitlines()[0] if str(exc) else ""
            raise RuntimeInputError(f"{self.source}: the chat template failed ({type(exc).__name__}: {text})") from None


def load_chat_template(folder: Path) -> ChatTemplate:
    """The chat template of an export (or model) folder; a one-line error when it has none."""
    cfg_path = folder / "tokenizer_config.json"
    tok_cfg = _read_json(cfg_path) if cfg_path.is_file() else {}
    special = {}
    map_path = folder / "special_tokens_map.json"
    for src in (_read_json(map_path) if map_path.is_file() else {}, tok_cfg):
        for key in SPECIAL_TOKEN_KEYS:
            text = _token_text(src.get(key))
            if text is not None:
                special[key] = text
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.is_file():
        try:
            return ChatTemplate(jinja_path, jinja_path.read_text(encoding="utf-8"), special)
        except (OSError, UnicodeDecodeError) as exc:
            raise RuntimeInputError(f"{jinja_path}: unreadable ({exc})") from None
    tmpl = tok_cfg.get("chat_template")
    if isinstance(tmpl, list):  # transformers' legacy form for several named templates
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        tmpl = named.get("default")
    if not isinstance(tmpl, str) or not tmpl.strip():
        raise RuntimeInputError(f"--chat needs a chat template, and {folder} has none (no chat_template.jinja, "
                                f"no 'chat_template' in tokenizer_config.json); give the prompt as text instead")
    return ChatTemplate(cfg_path, tmpl, special)


_ENV = None


def _environment():
    global _ENV
    if _ENV is not None:
        return _ENV
    try:
        import jinja2
        import jinja2.ext
    except ImportError:
        raise MissingDependencyError("--chat needs the 'jinja2' package (pip install jinja2)") from None

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker) renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = template_budget.sandbox_class()(trim_blocks=True, lstrip_blocks=True,
                                          extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    # every filter size-checked (``'x'|center(10**10)`` would allocate before any time budget could stop it)
    env.filters = {name: template_budget.guard_filter(f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    _ENV = env
    return env


def chat_prompt_ids(tokenizer, template: ChatTemplate, text: str, system: str | None = None) -> list[int]:
    """Token ids of one user turn (after an optional system turn) with the assistant's turn opened."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    rendered = template.render(messages, add_generation_prompt=True)
    return list(tokenizer.encode(rendered, add_special_tokens=False).ids)

"""Issue 22, class 2: a chat template that loops or builds a gigantic string ends in one line within its budget
(time: ``template_budget.TIME_BUDGET_S``, size: ``template_budget.MAX_CHARS``), never runs on."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qeff_kv.errors import RuntimeInputError
from qeff_kv.runtime.text import template_budget
from qeff_kv.runtime.text.chat import ChatTemplate

pytest.importorskip("jinja2")

MESSAGES = [{"role": "user", "content": "hi"}]
BIG = st.integers(min_value=template_budget.MAX_CHARS + 1, max_value=10**15)


def _render(template: str) -> str:
    return ChatTemplate(Path("t.jinja"), template).render(MESSAGES)


def _stopped(template: str) -> str:
    with pytest.raises(RuntimeInputError) as exc:
        _render(template)
    msg = str(exc.value)
    assert msg.startswith("t.jinja: the chat template was stopped: ") and "\n" not in msg, msg
    return msg.removeprefix("t.jinja: the chat template was stopped: ")


def test_nested_ranges_stop_at_the_real_budget():
    t0 = time.monotonic()
    why = _stopped("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    elapsed = time.monotonic() - t0
    assert why == f"rendering took more than {template_budget.TIME_BUDGET_S:g} s (a loop that does not end?)"
    assert elapsed < template_budget.TIME_BUDGET_S + 2.0, elapsed


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(depth=st.integers(min_value=2, max_value=4), n=st.integers(min_value=2000, max_value=100000),
       body=st.sampled_from(["", "x", "{{ i }}", "{% set k = i %}"]))
def test_looping_templates_stop_within_the_budget(monkeypatch, depth, n, body):
    monkeypatch.setattr(template_budget, "TIME_BUDGET_S", 0.2)
    names = "ijklm"
    tmpl = "".join(f"{{% for {names[d]} in range({n}) %}}" for d in range(depth)) + body \
        + "{% endfor %}" * depth
    t0 = time.monotonic()
    try:
        out = _render(tmpl)
    except RuntimeInputError as exc:
        assert str(exc) in ("t.jinja: the chat template was stopped: rendering took more than 0.2 s (a loop that "
                            "does not end?)",
                            f"t.jinja: the chat template was stopped: the rendered prompt exceeds "
                            f"{template_budget.MAX_CHARS} characters")
    else:   # finished within the budget: then it is the whole output
        assert len(out) <= template_budget.MAX_CHARS
    assert time.monotonic() - t0 < 1.5


@settings(max_examples=25, deadline=None)
@given(n=BIG, form=st.sampled_from([
    ("{{ 'ab' * N }}", "repeating a value of 2 items N times exceeds the cap of CAP"),
    ("{{ 'x'|center(N) }}", "filter 'center' with argument N (values are capped at CAP characters)"),
    ("{{ 'x'|indent(N) }}", "filter 'indent' with argument N (values are capped at CAP characters)"),
    ("{{ 'x'.ljust(N) }}", "calling 'ljust' with argument N (values are capped at CAP characters)"),
    ("{{ '%*s' % (N, 'a') }}", "'%' formatting with argument N (values are capped at CAP characters)"),
    ("{{ [0] * N }}", "repeating a value of 1 items N times exceeds the cap of CAP"),
]))
def test_gigantic_values_are_refused_before_they_are_built(n, form):
    tmpl, why = form
    cap = str(template_budget.MAX_CHARS)
    assert _stopped(tmpl.replace("N", str(n))) == why.replace("N", str(n)).replace("CAP", cap)


@pytest.mark.parametrize("tmpl,why", [
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     r"a namespace value grew to \d+ items \(the cap is 4194304\)"),
    ("{% set ns = namespace(s=[1]) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     r"'\+' would build a value of 8388608 items \(the cap is 4194304\)"),
    ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}",
     r"the rendered prompt exceeds 4194304 characters"),
])
def test_strings_grown_in_a_loop_are_stopped(tmpl, why):
    assert template_budget.MAX_CHARS == 4194304
    t0 = time.monotonic()
    assert re.fullmatch(why, _stopped(tmpl))
    assert time.monotonic() - t0 < 2.0


def test_ordinary_templates_render_as_before():
    assert _render("{% for m in messages %}<{{ m.role }}>{{ m.content|upper }}{% endfor %}"
                   "{{ '%s!' % 'ok' }}{{ 'ab' * 2 }}{{ 2 ** 10 }}") == \
        "<user>HIok!abab1024"


def test_cli_generate_chat_with_a_looping_template_is_one_line(tmp_path, monkeypatch):
    from cli_checks import cli, one_error, tree
    from test_chat_template import _folder

    monkeypatch.setattr(template_budget, "TIME_BUDGET_S", 0.3)
    folder = _folder(tmp_path, template="{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}"
                                        "{% endfor %}")
    before = tree(tmp_path)
    line = one_error(cli("generate", folder, "--chat", "--prompt", "hi"))
    assert line == (f"error: {folder / 'tokenizer_config.json'}: the chat template was stopped: rendering took more "
                    "than 0.3 s (a loop that does not end?)")
    assert tree(tmp_path) == before

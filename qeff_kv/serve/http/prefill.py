"""Assistant prefill: a chat whose last message is the assistant's, continued rather than answered as a new turn.

vLLM's fields (chat completions and ``/tokenize``): ``continue_final_message: true`` renders the chat so that the
final message stays open (no end-of-turn after it) and the model continues it; ``add_generation_prompt`` (default
true) adds the template's opening of a new assistant turn; both true is refused, as vLLM refuses it. A trailing
assistant message with text (no ``tool_calls``) is also continued when ``add_generation_prompt`` is false, or when
neither field is given (llama-server's default: its "assistant prefill"). The answer is then the continuation
only, as both servers answer it.

The open rendering is transformers' ``continue_final_message``: the chat rendered without a generation prompt, cut
right after the last occurrence of the final message's text (its stripped text where the template strips it); a
template that does not write the text at all is refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass

from qeff_kv.serve.wire.openai_io import bad


@dataclass(frozen=True)
class Turn:
    """How a chat is closed: ``continue_final`` (the last message left open) or ``add_generation_prompt``."""

    add_generation_prompt: bool = True
    continue_final: bool = False


def _flag(body: dict, key: str) -> bool | None:
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise bad(f"{key} must be true or false, got {v!r}", key)
    return v


def parse_turn(body: dict, messages) -> Turn:
    """The request's :class:`Turn` (``messages``: the checked messages, or the raw list)."""
    cont, agp = _flag(body, "continue_final_message"), _flag(body, "add_generation_prompt")
    last = messages[-1] if isinstance(messages, list) and messages and isinstance(messages[-1], dict) else {}
    open_text = last.get("role") == "assistant" and isinstance(last.get("content"), str) and bool(last["content"]) \
        and not last.get("tool_calls")
    if cont and agp:
        raise bad("continue_final_message and add_generation_prompt cannot both be true (continue the final "
                  "message, or open a new assistant turn)", "continue_final_message")
    if cont and not open_text:
        raise bad("continue_final_message needs the final message to be the assistant's, with text to continue",
                  "continue_final_message")
    if cont or (open_text and agp is not True):
        return Turn(add_generation_prompt=False, continue_final=True)
    return Turn(add_generation_prompt=agp is not False)


def render(template, messages: list[dict], turn: Turn, tools=None) -> str:
    """The chat rendered as ``turn`` says (see the module docstring)."""
    rendered = template.render(messages, add_generation_prompt=turn.add_generation_prompt, tools=tools)
    if not turn.continue_final:
        return rendered
    final = messages[-1].get("content") or ""
    for text in (final, final.strip()):
        at = rendered.rfind(text) if text else -1
        if at >= 0:
            return rendered[:at + len(text)]
    raise bad("continue_final_message: the chat template does not write the final message's text, so it cannot "
              "be continued", "messages")

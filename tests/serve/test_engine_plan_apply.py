"""Plan, then apply (issue 48): the local engine's collaborators hold no scheduler; each takes its inputs and
returns outcomes, and the :class:`~qeff_kv.serve.engine.scheduler.Scheduler` alone applies them. Each collaborator
is tested here against a fake session (numpy only, no onnxruntime), and the structure itself is checked: no
collaborator names, takes or stores the scheduler, and the scheduler stays at most 20 methods."""

from __future__ import annotations

import ast
import gc
import threading
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from qeff_kv.errors import QeffKvError, QueueFullError, UnavailableError
from qeff_kv.runtime.decoding.sampling import Pick, SamplingParams
from qeff_kv.serve.engine.active import admitted
from qeff_kv.serve.engine.decode_step import LOWER_MIN_LEFT, Failed, Step, decode, to_lower
from qeff_kv.serve.engine.engine import GenerationRequest, PromptLogprobs, RequestHandle
from qeff_kv.serve.engine.forks import ChoiceGroups, Forks
from qeff_kv.serve.engine.inbox import Inbox
from qeff_kv.serve.engine.prefill_turns import PrefillTurns, Turn

ENGINE = Path(__file__).resolve().parents[2] / "qeff_kv" / "serve" / "engine"
#: the engine's collaborators: every module of the engine but the scheduler itself, its interface and start-up
COLLABORATORS = sorted(p for p in ENGINE.glob("*.py")
                       if p.name not in ("scheduler.py", "__init__.py", "session_from_config.py", "defaults.py"))
VOCAB = 8


# ------------------------------------------------------------------------------------ fakes
class FakeSeq:
    def __init__(self, slot: int, length: int = 0):
        self.slot, self.length, self.tokens = slot, length, []
        self.pending, self.pending_emitted, self.alive = None, False, True


class FakeSession:
    """What the collaborators read of a session: decode, prefill, copy, the prefill length, the timings."""

    def __init__(self, prefill_seq_len: int = 4, fail_prefill: set | None = None, copy_error=None):
        self.prefill_seq_len, self.recurrent = prefill_seq_len, False
        self.speculative = False   # the last row's logits only: prompt logprobs fed position by position
        self.timings = SimpleNamespace(prefill_runs=0)
        self.fed: list[tuple[int, list[int]]] = []
        self.fail_prefill, self.copy_error = fail_prefill or set(), copy_error
        self.copies: list[tuple[int, int, int]] = []

    def logits(self, hot: int) -> np.ndarray:
        row = np.zeros(VOCAB, np.float32)
        row[hot % VOCAB] = 5.0
        return row

    def decode(self, feeds):
        out = {}
        for seq, tok in feeds:
            seq.length += 1
            out[seq] = self.logits(tok + 1)
        return out

    def prefill(self, seq, chunk, **kw):
        if seq.slot in self.fail_prefill:
            raise RuntimeError("boom")
        self.fed.append((seq.slot, list(chunk)))
        self.timings.prefill_runs += -(-len(chunk) // self.prefill_seq_len)
        seq.length += len(chunk)
        return self.logits(chunk[-1] + 1)

    def copy(self, src, dst, n):
        if self.copy_error is not None:
            raise self.copy_error
        self.copies.append((src.slot, dst.slot, n))
        dst.length = n


def request(i: int, prompt=(1, 2, 3), max_tokens=4, **kw) -> GenerationRequest:
    return GenerationRequest(f"r{i}", tuple(prompt), max_tokens, SamplingParams(), frozenset(), **kw)


def active(i: int, prompt=(1, 2, 3), max_tokens=4, todo=None, seq=None):
    req = request(i, prompt, max_tokens)
    a = admitted(RequestHandle(req.request_id), req, seq or FakeSeq(i), ctx_len=64, vocab_size=VOCAB,
                 todo=list(prompt) if todo is None else todo)
    a.last = prompt[-1]
    return a


# ------------------------------------------------------------------------------------ the structure
def _names_the_scheduler(path: Path) -> list[str]:
    """Where ``path`` imports the scheduler, names ``Scheduler``, takes a ``sched``/``scheduler`` parameter or
    stores such an attribute (docstrings aside)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.endswith("scheduler"):
            found.append(f"imports {node.module}")
        elif isinstance(node, ast.Import) and any(a.name.endswith("scheduler") for a in node.names):
            found.append("imports the scheduler")
        elif isinstance(node, ast.Name) and node.id == "Scheduler":
            found.append(f"line {node.lineno}: names Scheduler")
        elif isinstance(node, ast.arg) and node.arg in ("sched", "scheduler"):
            found.append(f"line {node.lineno}: takes {node.arg}")
        elif isinstance(node, ast.Attribute) and node.attr in ("sched", "scheduler"):
            found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_no_engine_collaborator_takes_or_holds_the_scheduler():
    assert {p.name for p in COLLABORATORS} >= {"decode_step.py", "prefill_turns.py", "forks.py", "inbox.py"}
    offenders = {p.name: f for p in COLLABORATORS if (f := _names_the_scheduler(p))}
    assert offenders == {}


def test_the_finder_sees_a_collaborator_that_keeps_the_scheduler(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("class Step:\n    def __init__(self, sched):\n        self.sched = sched\n")
    assert len(_names_the_scheduler(bad)) == 2


def test_the_scheduler_has_at_most_20_methods():
    tree = ast.parse((ENGINE / "scheduler.py").read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Scheduler"]
    methods = [n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert len(methods) <= 20, methods


def _reaches(roots: list, target) -> bool:
    """``target`` is reachable from ``roots`` through object references (classes, modules and functions' globals
    aside: they lead to everything)."""
    seen, todo = set(), list(roots)
    while todo:
        obj = todo.pop()
        if obj is target:
            return True
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FrameType)):
            continue
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            todo.extend(c.cell_contents for c in obj.__closure__ or () if _filled(c))
            continue
        todo.extend(gc.get_referents(obj))
    return False


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def test_a_running_schedulers_collaborators_never_reach_it(own_cb_graph):
    """Behavioural: while requests run (``n`` choices forked, prompts prefilling, rows decoding), nothing the
    collaborators hold (the inbox and its waiting handles, the prefill turns and their requests, the parked
    choices) leads back to the scheduler; and the tokens are those of a request alone."""
    from qeff_kv.runtime import Session
    from qeff_kv.serve.engine.scheduler import Scheduler

    session = Session(own_cb_graph)
    sched = Scheduler(session, reuse_prompts=False, prefill_chunk=4)
    try:
        assert sched.run_on_engine(("call", lambda s: _reaches([{"k": [s.close]}], s))).result(30)  # the finder
        hold = threading.Event()
        sched.run_on_engine(("call", lambda _: hold.wait(30)))
        handles = sched.submit_n(request(0, (5, 6, 7, 8, 9, 10), 6), [SamplingParams()] * 2)
        handles.append(sched.submit(request(1, (11, 12, 13), 6)))
        looks = []
        hold.set()
        while not all(h.finished for h in handles):   # a look between two turns, again and again
            looks.append(sched.run_on_engine(("call", lambda s: (
                _reaches([s.inbox, s.turns, s.choices], s),
                bool(s.turns.queue) + bool(s.choices.parked) + bool(s.running)))).result(30))
        outs = [[e.token for e in h.iter_sync(timeout=60) if hasattr(e, "token")] for h in handles]
    finally:
        sched.close()
    assert not any(reached for reached, _ in looks) and any(busy for _, busy in looks)
    assert outs[0] == outs[1] and all(len(o) == 6 for o in outs)


# ------------------------------------------------------------------------------------ the decode step
def test_decode_returns_each_rows_pick_and_the_steps_time():
    batch = [active(0), active(1, prompt=(4, 5))]
    step = decode(FakeSession(), batch)
    assert step.error is None and step.seconds >= 0
    assert [type(r) for r in step.rows] == [Pick, Pick]
    assert [r.token for r in step.rows] == [4, 6]                 # the fake's logits peak at fed token + 1
    assert all(a.generated == 0 and a.seq.pending is None for a in batch)   # nothing applied: the scheduler does


def test_decode_returns_a_failed_selection_for_its_row_only():
    batch = [active(0), active(1)]
    batch[1].select = lambda logits: (_ for _ in ()).throw(ValueError("bad row"))
    step = decode(FakeSession(), batch)
    assert isinstance(step.rows[0], Pick) and step.rows[1] == Failed("sampling failed: bad row")


def test_decode_returns_one_error_when_the_step_fails():
    session = FakeSession()
    session.decode = lambda feeds: (_ for _ in ()).throw(RuntimeError("graph"))
    assert decode(session, [active(0), active(1)]) == Step(rows=[], error="decode failed: graph", seconds=0.0)


def test_decode_with_a_speculation_returns_its_runs():
    seen = []

    class FakeSpeculation:
        def step(self, rows):
            seen.extend((r.key.req.request_id, r.last, r.left) for r in rows)
            return [[7, 8], [9]]

    batch = [active(0), active(1)]
    step = decode(FakeSession(), batch, FakeSpeculation())
    assert step.rows == [[7, 8], [9]] and seen == [("r0", 3, 4), ("r1", 3, 4)]


def test_to_lower_names_the_top_rows_sequence_only_with_tokens_left():
    low, top = active(0, max_tokens=LOWER_MIN_LEFT), active(3, max_tokens=LOWER_MIN_LEFT)
    assert to_lower([low, top]) is top.seq
    top.generated = 1
    assert to_lower([low, top]) is None


# ------------------------------------------------------------------------------------ the prefill turn
def test_a_turn_returns_the_prompts_it_completed_oldest_first():
    session = FakeSession(prefill_seq_len=4)
    turns = PrefillTurns(session, prefill_chunk=8)
    a, b = active(0, prompt=(1, 2, 3)), active(1, prompt=(4, 5))
    turns.enqueue(a)
    turns.enqueue(b)
    turn = turns.turn(running=False)
    assert [x for x, _ in turn.done] == [a, b] and turn.failed == [] and turn.runs == 2
    assert int(np.argmax(turn.done[0][1])) == 4 and turns.queue == []
    assert a.generated == 0 and a.seq.pending is None              # nothing applied


def test_each_chunks_outcome_is_yielded_before_the_next_chunk_is_fed():
    """A prompt completed early in a turn reaches the scheduler before the turn's next prompt is fed (its first
    token is not held back by the rest of the turn); a request enqueued meanwhile is fed while the budget lasts."""
    session = FakeSession(prefill_seq_len=4)
    turns = PrefillTurns(session, prefill_chunk=8)
    a, b, c = active(0, prompt=(1, 2, 3)), active(1, prompt=(4, 5)), active(2, prompt=(6,))
    turns.enqueue(a)
    turns.enqueue(b)
    feeds = turns.feeds(running=False)
    first = next(feeds)
    assert [x for x, _ in first.done] == [a] and first.runs == 1 and len(session.fed) == 1
    turns.enqueue(c)                                   # e.g. a choice sent back to prefill by a's fork
    rest = list(feeds)
    assert [[x for x, _ in part.done] for part in rest] == [[b], [c]] and len(session.fed) == 3
    assert turns.queue == []


def test_a_turn_cuts_a_long_prompt_at_whole_prefill_lengths():
    session = FakeSession(prefill_seq_len=4)
    turns = PrefillTurns(session, prefill_chunk=6)
    a = active(0, prompt=tuple(range(1, 11)))
    turns.enqueue(a)
    turn = turns.turn(running=False)
    assert turn == Turn(runs=1) and session.fed == [(0, [1, 2, 3, 4])] and turns.queue == [a]
    assert a.todo == [5, 6, 7, 8, 9, 10]


def test_a_failed_prefill_leaves_the_queue_and_the_turn_goes_on():
    session = FakeSession(fail_prefill={0})
    turns = PrefillTurns(session, prefill_chunk=8)
    a, b = active(0, prompt=(1, 2)), active(1, prompt=(3, 4))
    turns.enqueue(a)
    turns.enqueue(b)
    turn = turns.turn(running=False)
    assert turn.failed == [(a, "prefill failed: boom")] and [x for x, _ in turn.done] == [b]
    assert turns.queue == []


def test_prompt_logprobs_are_returned_not_emitted(monkeypatch):
    from qeff_kv.serve.engine import prefill_turns

    monkeypatch.setattr(prefill_turns, "prefill_rows",
                        lambda session, seq, chunk, **kw: np.stack([session.logits(t + 1) for t in chunk]))
    turns = PrefillTurns(FakeSession(), prefill_chunk=8)
    a = active(0, prompt=(1, 2, 3))
    a.req = request(0, (1, 2, 3), prompt_logprobs=1)
    turns.enqueue(a)
    turn = turns.turn(running=False)
    [(who, event)] = turn.scored
    assert who is a and isinstance(event, PromptLogprobs) and [e[0] for e in event.entries] == [1, 2, 3]
    with pytest.raises(TimeoutError):   # nothing emitted: the scheduler emits what the turn returns
        next(a.handle.iter_sync(timeout=0))


def test_a_prompt_scored_position_by_position_leaves_running_streams_their_pace(monkeypatch):
    """Issue 52: on a graph returning its last row only, a scored prompt costs one graph run per position; while
    sequences decode, a turn feeds it as many positions as a plain turn makes runs (budget / prefill length), so
    the running streams step between its chunks; with nothing running it takes the whole budget."""
    from qeff_kv.serve.engine import prefill_turns

    fed = []

    def rows(session, seq, chunk, **kw):
        fed.append(len(chunk))
        session.timings.prefill_runs += len(chunk)
        seq.length += len(chunk)
        return np.stack([session.logits(t + 1) for t in chunk])

    monkeypatch.setattr(prefill_turns, "prefill_rows", rows)
    turns = PrefillTurns(FakeSession(prefill_seq_len=4), prefill_chunk=8)
    a = active(0, prompt=tuple(i % 7 + 1 for i in range(20)))
    a.req = request(0, a.req.prompt, prompt_logprobs=0)
    b = active(1, prompt=(1, 2))
    turns.enqueue(a)
    turns.enqueue(b)
    turn = turns.turn(running=True)
    assert fed == [2] and turn.runs == 2 and len(a.todo) == 18 and turns.queue == [a, b]   # b waits its turn
    turns.turn(running=True)
    assert fed == [2, 2]
    turn = turns.turn(running=False)
    assert turn.failed == [] and fed == [2, 2, 8] and len(a.todo) == 8
    turns.chunk = 3   # a budget below one prefill length: still one position per turn
    turns.turn(running=True)
    assert fed[-1] == 1


def test_the_auto_turn_follows_the_decode_step_only_while_sequences_run():
    turns = PrefillTurns(FakeSession(prefill_seq_len=4), prefill_chunk="auto")
    turns.note_decode(0.01)
    turns.prefill_tok_s = 0.01
    assert turns.chunk_size(running=False) == 4 and turns.chunk_size(running=True) == 1


# ------------------------------------------------------------------------------------ the choice groups
def _parked(copy_error=None):
    session = FakeSession(copy_error=copy_error)
    groups = ChoiceGroups()
    leader = active(0, todo=[])
    leader.seq.length = 3
    others = [active(1, seq=FakeSeq(1)), active(2, seq=FakeSeq(2))]
    for f in others:
        groups.park(leader, f)
    return session, groups, leader, others


def test_a_fork_copies_the_prompt_and_returns_the_copied_choices():
    session, groups, leader, others = _parked()
    forks = groups.fork(leader, session, can_copy=True)
    assert forks == Forks(copied=others) and session.copies == [(0, 1, 3), (0, 2, 3)]
    assert [f.cached for f in others] == [3, 3] and groups.parked == {}


def test_a_fork_the_session_cannot_copy_returns_choices_to_prefill():
    session, groups, leader, others = _parked(copy_error=QeffKvError("no copy"))
    forks = groups.fork(leader, session, can_copy=True)
    assert forks.refeed == others and forks.copied == [] and [f.todo for f in others] == [[1, 2, 3]] * 2
    _, groups, leader, others = _parked()
    assert groups.fork(leader, session, can_copy=False).refeed == others


def test_a_cancelled_choice_ends_at_its_fork():
    session, groups, leader, others = _parked()
    others[0].handle.cancel()
    forks = groups.fork(leader, session, can_copy=True)
    assert forks.ends == [(others[0], "cancelled", None)] and forks.copied == [others[1]]


def test_when_the_leader_ends_its_choices_end_or_prefill_themselves():
    _, groups, leader, others = _parked()
    assert groups.leader_ended(leader, "error", "bad", closed=False).ends == [(f, "error", "bad") for f in others]
    _, groups, leader, others = _parked()
    alone = groups.leader_ended(leader, "cancelled", None, closed=False)
    assert alone.refeed == others and alone.ends == []
    _, groups, leader, others = _parked()
    assert [r for _, r, _ in groups.leader_ended(leader, "cancelled", None, closed=True).ends] == ["cancelled"] * 2


def test_parked_choices_are_busy_while_their_leader_prefills():
    _, groups, leader, others = _parked()
    assert groups.all_parked([leader]) == others and groups.all_parked([]) == []


# ------------------------------------------------------------------------------------ the inbox
def _group(inbox: Inbox, i: int, n: int = 1, max_queue: int = 4):
    reqs = [request(10 * i + k) for k in range(n)]
    handles = [RequestHandle(r.request_id) for r in reqs]
    inbox.put(handles, reqs, max_queue)
    return handles


def test_the_inbox_admits_a_group_when_its_members_fit():
    inbox = Inbox(max_sequences=2, kv_bytes_capacity=0)
    _group(inbox, 0, n=2)
    assert inbox.next_group(available=1) is None and not inbox.admissible(1)
    handle, req, others = inbox.next_group(available=2)
    assert req.request_id == "r0" and [r.request_id for _, r in others] == ["r1"] and inbox.admitted == 2
    inbox.left(2)
    assert inbox.admitted == 0


def test_the_inbox_refuses_when_full_or_closed():
    inbox = Inbox(max_sequences=1, kv_bytes_capacity=0)
    _group(inbox, 0, max_queue=1)
    _group(inbox, 1, max_queue=1)
    with pytest.raises(QueueFullError):
        _group(inbox, 2, max_queue=1)
    assert inbox.close() and not inbox.close()
    with pytest.raises(UnavailableError):
        _group(inbox, 3, max_queue=1)
    members, control = inbox.drain()
    assert [r.request_id for _, r in members] == ["r0", "r10"] and control == []


def test_cancelling_a_waiting_first_choice_takes_its_whole_group():
    inbox = Inbox(max_sequences=4, kv_bytes_capacity=0)
    first = _group(inbox, 0, n=3)
    _group(inbox, 1)
    first[0].cancel()
    assert [r.request_id for _, r in inbox.cancelled()] == ["r0", "r1", "r2"]
    assert [g[1].request_id for g in inbox.waiting] == ["r10"]


def test_control_actions_run_with_their_results_and_errors():
    inbox = Inbox(max_sequences=1, kv_bytes_capacity=0)
    ok, bad = inbox.run(("call", 2)), inbox.run(("call", 0))
    inbox.apply_control(lambda what: 10 // what[1])
    assert ok.result(0) == 5 and isinstance(bad.exception(0), ZeroDivisionError)

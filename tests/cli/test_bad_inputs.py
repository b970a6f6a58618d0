"""Bad inputs, as a new user would give them: each is refused with exit code 2 and exactly one ``error:`` line
(no traceback), nothing is written or destroyed, and the Python API raises qeff-kv's typed errors.

Then one property-based test per command throws random argument values at it (numbers of every size and sign,
odd paths, odd strings): exit 0, or exit 2 with exactly one ``error:`` line (``check`` may also exit 1).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import _kv_graphs as kg
from cli_checks import cli, one_error, tree
from suite import HAS_TORCH, requires_torch
from qeff_kv import errors
from qeff_kv.support import fsutil, limits
from qeff_kv.graph import graphio
from qeff_kv.tools.compile_config import custom_io_yaml
from qeff_kv.errors import MemoryLimitError, QeffKvError, RuntimeInputError, StateFileError

QEFF_KV = Path(sys.executable).with_name("qeff-kv")
TOO_BIG = "99999999999999999999999"  # beyond 64 bits
HUGE_CTX = "2000000000"  # fits the option's range, not any machine's memory for this graph


# ================================================================================================ helpers
@pytest.fixture(scope="module")
def graph(tmp_path_factory) -> Path:
    """A small retained-state graph (no torch needed) for rewrite/check/buffers/compile-config."""
    return kg.save(kg.build(2), tmp_path_factory.mktemp("graph") / "model.onnx")


@pytest.fixture(scope="module")
def dup_graph(tmp_path_factory) -> Path:
    """A graph that lists one output twice: ``check`` must fail it."""
    import onnx

    m = kg.build(2)
    m.graph.output.append(m.graph.output[1])
    path = tmp_path_factory.mktemp("dup") / "dup.onnx"
    onnx.save(m, str(path))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The bundled default exported (portable, no prefix): an export folder with manifest and tokenizer."""
    if not HAS_TORCH:
        pytest.skip("needs the [export] extra")
    from qeff_kv.export import export_model

    out = tmp_path_factory.mktemp("tiny") / "tiny"
    export_model(None, out, verify=False)
    return out


@pytest.fixture(scope="module")
def tiny_cb(tmp_path_factory) -> Path:
    if not HAS_TORCH:
        pytest.skip("needs the [export] extra")
    from qeff_kv.export import export_model

    out = tmp_path_factory.mktemp("tinycb") / "cb"
    export_model(None, out, verify=False, continuous_batching=True, full_batch_size=2)
    return out


def onnx_of(folder: Path) -> Path:
    return folder / json.loads((folder / "manifest.json").read_text())["onnx"]


# ================================================================================================ numbers
@pytest.mark.parametrize("args, needle", [
    (["buffers", "{graph}", "--ctx-len", TOO_BIG], "--ctx-len"),
    (["buffers", "{graph}", "--sliding-window", "0"], "--sliding-window"),
    (["compile-config", "{graph}", "-o", "{out}", "--ctx-len", "64", "--prefill-seq-len", "8", "--sliding-window",
      TOO_BIG], "--sliding-window"),
    (["compile-config", "{graph}", "-o", "{out}", "--ctx-len", TOO_BIG, "--prefill-seq-len", "8"], "--ctx-len"),
    (["compile-config", "{graph}", "-o", "{out}", "--ctx-len", str(2**40), "--prefill-seq-len", "8"], "--ctx-len"),
    (["compile-config", "{graph}", "-o", "{out}", "--ctx-len", "64", "--prefill-seq-len", "-3"],
     "--prefill-seq-len"),
    (["compile-config", "{graph}", "-o", "{out}", "--ctx-len", "64", "--prefill-seq-len", "8", "--batch-size", "0"],
     "--batch-size"),
    (["export", "-o", "{out}", "--no-verify", "--ctx-len", TOO_BIG], "--ctx-len"),
    (["export", "-o", "{out}", "--no-verify", "--prefill-seq-len", TOO_BIG], "--prefill-seq-len"),
    (["export", "-o", "{out}", "--no-verify", "--continuous-batching", "--full-batch-size", "-1"],
     "--full-batch-size"),
    (["generate", "{graph}", "--prompt-ids", "1", "--ctx-len", TOO_BIG], "--ctx-len"),
    (["generate", "{graph}", "--prompt-ids", "1", "--prefill-seq-len", TOO_BIG], "--prefill-seq-len"),
    (["generate", "{graph}", "--prompt-ids", "1", "--threads", "-2"], "--threads"),
    (["generate", "{graph}", "--prompt-ids", "1", "--max-new-tokens", "-1"], "--max-new-tokens"),
    (["generate", "{graph}", "--prompt-ids", "1", "--seed", TOO_BIG], "--seed"),
    (["generate", "{graph}", "--prompt-ids", TOO_BIG, "--ctx-len", "8"], "64 bits"),
])
def test_numbers_out_of_range_are_usage_errors(args, needle, graph, tmp_path):
    out = tmp_path / "out"
    before = tree(tmp_path)
    res = cli(*[a.format(graph=graph, out=out) for a in args])
    one_error(res, needle)
    assert tree(tmp_path) == before


@requires_torch
def test_ctx_len_too_large_to_allocate_generate(tiny, tmp_path):
    res = cli("generate", tiny, "--prompt-ids", "1,2", "--ctx-len", HUGE_CTX, "--max-new-tokens", "1")
    line = one_error(res, "KV buffers", "bytes", "does not fit")
    assert "TiB" in line or "GiB" in line or "PiB" in line


@requires_torch
def test_ctx_len_too_large_to_allocate_export(tmp_path):
    out = tmp_path / "out"
    res = cli("export", "-q", "-o", out, "--no-verify", "--ctx-len", HUGE_CTX)
    one_error(res, "probe KV tensors", "does not fit")
    assert list(tmp_path.iterdir()) == []  # not even a staging folder


@requires_torch
def test_generate_prefill_longer_than_ctx_len(tiny):
    res = cli("generate", onnx_of(tiny), "--prompt-ids", "1,2", "--ctx-len", "64", "--prefill-seq-len", "128",
              "--max-new-tokens", "1")
    one_error(res, "--prefill-seq-len 128 is larger than the capacity ctx_len 64")


@requires_torch
def test_generate_more_sequences_than_exported_slots(tiny_cb):
    res = cli("generate", tiny_cb, "--prompt-ids", "1,2", "--prompt-ids", "3", "--prompt-ids", "4",
              "--max-new-tokens", "1")
    one_error(res, "3 new sequences", "2 of 2 slots")
    res = cli("generate", tiny_cb, "--prompt-ids", "1,2", "--max-sequences", "3", "--max-new-tokens", "1")
    one_error(res, "full_batch_size=2", "3 sequences")
    ok = cli("generate", tiny_cb, "--prompt-ids", "1,2", "--prompt-ids", "3", "--max-new-tokens", "1")
    assert ok.exit_code == 0, ok.output


# ================================================================================================ paths
@pytest.fixture
def blocker(tmp_path) -> Path:
    """A regular file that an output path goes *through*."""
    f = tmp_path / "afile"
    f.write_text("keep me\n")
    return f


def _assert_blocker_intact(blocker: Path, before: dict, tmp_path: Path) -> None:
    assert blocker.read_text() == "keep me\n"
    assert tree(tmp_path) == before


def test_rewrite_output_below_a_file(graph, blocker, tmp_path):
    before = tree(tmp_path)
    one_error(cli("rewrite", graph, "-o", blocker / "x.onnx", "--kv-cache-prefix", "VLLM"), "afile", "not a folder")
    _assert_blocker_intact(blocker, before, tmp_path)


def test_compile_config_output_below_a_file(graph, blocker, tmp_path):
    before = tree(tmp_path)
    res = cli("compile-config", graph, "-o", blocker / "sub", "--ctx-len", "64", "--prefill-seq-len", "8")
    one_error(res, "afile", "not a folder")
    _assert_blocker_intact(blocker, before, tmp_path)


@requires_torch
def test_export_output_below_a_file(blocker, tmp_path):
    before = tree(tmp_path)
    one_error(cli("export", "-q", "-o", blocker / "out", "--no-verify"), "afile", "not a folder")
    _assert_blocker_intact(blocker, before, tmp_path)


@requires_torch
def test_save_state_below_a_file(tiny, blocker, tmp_path):
    before = tree(tmp_path)
    res = cli("generate", tiny, "--prompt-ids", "1,2", "--max-new-tokens", "0", "--save-state", blocker / "s.st")
    one_error(res, "afile", "not a folder")
    _assert_blocker_intact(blocker, before, tmp_path)


def test_rewrite_onto_a_fifo_keeps_it(graph, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    one_error(cli("rewrite", graph, "-o", fifo, "--kv-cache-prefix", "VLLM"), "FIFO", "regular file")
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["fifo"]


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="no /dev/null")
def test_rewrite_onto_a_device_node_keeps_it(graph):
    mode = os.lstat("/dev/null").st_mode
    one_error(cli("rewrite", graph, "-o", "/dev/null", "--kv-cache-prefix", "VLLM"), "device node")
    assert stat.S_ISCHR(os.lstat("/dev/null").st_mode) and os.lstat("/dev/null").st_mode == mode


def test_fsutil_refuses_non_regular_targets(tmp_path):
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    with pytest.raises(errors.OutputError, match="FIFO"):
        fsutil.write_text(fifo, "x")
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    (tmp_path / "file").write_text("x")
    with pytest.raises(errors.OutputError, match="not a folder"):
        fsutil.write_text(tmp_path / "file" / "deeper" / "y.txt", "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f", "file"]


# ================================================================================================ model folders
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    if not HAS_TORCH:
        pytest.skip("needs the [export] extra")
    from hf_models import make_model_dir

    return make_model_dir("llama", tmp_path_factory.mktemp("hf"))


def _variant(hf_dir: Path, tmp_path: Path, fn) -> Path:
    d = tmp_path / "model"
    shutil.copytree(hf_dir, d)
    fn(d)
    return d


def _set_config(**kw):
    def fn(d: Path):
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(kw)
        (d / "config.json").write_text(json.dumps(cfg))
    return fn


def _truncate(d: Path):
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _as_folder(d: Path):
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").mkdir()


@requires_torch
@pytest.mark.parametrize("fn, needles", [
    (_truncate, ("model.safetensors: the tensors cover", "(truncated: a corrupt file)")),
    (_as_folder, ("model.safetensors", "is not a file")),
    (_set_config(hidden_size=128), ("weights do not match config.json",)),
    (_set_config(num_hidden_layers=5), ("weights do not match config.json", "missing")),
    (_set_config(num_hidden_layers="two"), ("'num_hidden_layers' must be a positive integer", "'two'")),
    (_set_config(max_position_embeddings="big"), ("'max_position_embeddings'",)),
    (_set_config(num_attention_heads=2.5), ("'num_attention_heads'",)),
    (_set_config(architectures="LlamaForCausalLM"), ("'architectures' must be a list",)),
], ids=["truncated", "folder", "shape-mismatch", "missing-layers", "str-layers", "str-positions", "float-heads",
        "str-architectures"])
def test_bad_model_folder(fn, needles, hf_dir, tmp_path):
    model = _variant(hf_dir, tmp_path, fn)
    out = tmp_path / "out"
    one_error(cli("export", model, "-q", "-o", out, "--no-verify"), *needles)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no staging folder left either


# ================================================================================================ silent acceptance
def test_compile_config_precision_is_validated(graph, tmp_path):
    out = tmp_path / "cc"
    res = cli("compile-config", graph, "-o", out, "--ctx-len", "64", "--prefill-seq-len", "8",
              "--precision", "float16\nfoo: bar")
    one_error(res, "--precision")
    assert not out.exists()
    layout = graphio.layout_of(graphio.load(graph))
    with pytest.raises(RuntimeInputError, match="unknown KV precision"):
        custom_io_yaml(layout, "float16\nfoo: bar")
    ok = cli("compile-config", graph, "-o", out, "--ctx-len", "64", "--prefill-seq-len", "8", "--precision", "mxint8")
    assert ok.exit_code == 0 and "Precision: mxint8" in (out / "custom_io.yaml").read_text()


def test_check_fails_a_duplicated_output(dup_graph):
    res = cli("check", dup_graph, "--skip-onnx-checker")
    assert res.exit_code == 1 and "listed twice" in res.stdout and "FAIL  pairing" in res.stdout


def test_compile_config_refuses_a_graph_check_fails(dup_graph, tmp_path):
    out = tmp_path / "cc"
    one_error(cli("compile-config", dup_graph, "-o", out, "--ctx-len", "64", "--prefill-seq-len", "8"),
              "fails check rule 'pairing'", "listed twice")
    assert not out.exists()


@requires_torch
def test_invalid_select_regex_refused_even_without_save(tiny):
    one_error(cli("generate", tiny, "--prompt-ids", "1,2", "--max-new-tokens", "1", "--select", "(["),
              "--select", "not a valid regex")


# ================================================================================================ one line
@pytest.mark.parametrize("args, needle", [
    (["generate", "x.onnx", "--no-such-option"], "No such option"),
    (["generate"], "Missing argument 'MODEL'"),
    (["no-such-command"], "No such command"),
    (["--no-such-flag"], "No such option"),
    (["export", "--dtype", "int3"], "--dtype"),
    (["check", "m.onnx", "--kv-cache-prefix", "A", "--no-kv-cache-prefix"], "not both"),
])
def test_usage_errors_are_one_line(args, needle, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    one_error(cli(*args), needle, "-h")
    assert list(tmp_path.iterdir()) == []


@requires_torch
def test_no_onnxruntime_log_lines_before_the_error(tiny, tmp_path):
    """A graph onnxruntime warns about (an unused initializer) and a bad token id: one line, nothing else."""
    import onnx
    from onnx import numpy_helper

    folder = tmp_path / "m"
    shutil.copytree(tiny, folder)
    path = onnx_of(folder)
    m = onnx.load(str(path))
    m.graph.initializer.append(numpy_helper.from_array(np.zeros(3, np.float32), "unused_init"))
    onnx.save(m, str(path))
    proc = subprocess.run([str(QEFF_KV), "generate", str(folder), "--prompt-ids", "100000", "--max-new-tokens", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: token id 100000"), proc.stderr


@requires_torch
def test_a_fused_head_size_onnxruntime_cannot_run_is_refused_before_loading(tmp_path):
    """head_dim 24 on --target onnxruntime-fused: onnxruntime's CPU GroupQueryAttention runs multiples of 16 only,
    so the export is refused from the config in one line (it used to load, trace and fail verification), and
    nothing is written."""
    from hf_models import make_model_dir

    model = make_model_dir("llama", tmp_path, head_dim=24)
    (model / "model.safetensors").write_bytes(b"not read")   # refused before any weight is read
    out = tmp_path / "o"
    proc = subprocess.run([str(QEFF_KV), "export", str(model), "-q", "-o", str(out), "--target", "onnxruntime-fused",
                           "--ctx-len", "32", "--prefill-seq-len", "4"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: --target onnxruntime-fused cannot express LlamaForCausalLM's attention head size 24: onnxruntime's "
        "CPU GroupQueryAttention runs head sizes that are a multiple of 16 only; use --target onnxruntime"]
    assert not out.exists()


_FAILING_NODE = """
import sys
import numpy as np
import onnx
from onnx import TensorProto, helper
from qeff_kv.export.probe_runner import first_line, open_session_on
graph = helper.make_graph([helper.make_node("Reshape", ["x", "s"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6]),
                           helper.make_tensor_value_info("s", TensorProto.INT64, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), sys.argv[1])
session = open_session_on(sys.argv[1])
try:
    session.run(None, {"x": np.zeros(6, np.float32), "s": np.array([7], np.int64)})
except Exception as exc:
    print("failed:", first_line(exc))
"""


def test_no_onnxruntime_log_line_when_a_node_fails_at_run_time(tmp_path):
    """A node failing at run time in the export's verification session (a Reshape to an impossible shape): our
    code gets the error, and onnxruntime's own ``[E:onnxruntime...]`` line (logged from C++ to the real fd 2,
    hence a subprocess) stays quiet; with ``QEFF_KV_DEBUG`` it shows."""
    script = tmp_path / "fail.py"
    script.write_text(_FAILING_NODE)
    env = {k: v for k, v in os.environ.items() if k != "QEFF_KV_DEBUG"}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "g.onnx")], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("failed: ") and "Reshape" in proc.stdout, proc.stdout
    assert "[E:onnxruntime" not in proc.stderr, proc.stderr
    loud = subprocess.run([sys.executable, str(script), str(tmp_path / "g.onnx")], capture_output=True, text=True,
                          timeout=120, env={**env, "QEFF_KV_DEBUG": "1"})
    assert "[E:onnxruntime" in loud.stderr, loud.stderr


@requires_torch
def test_quiet_export_of_a_folder_prints_nothing_on_stderr(hf_dir, tmp_path):
    """No transformers "Loading weights" progress bar under -q (a subprocess: the bar writes to the real fd)."""
    proc = subprocess.run([str(QEFF_KV), "export", str(hf_dir), "-q", "-o", str(tmp_path / "o"), "--no-verify"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""


# ================================================================================================ Python API
@requires_torch
def test_api_raises_typed_errors(tiny, tmp_path):
    from qeff_kv.runtime import Session, load_state
    from qeff_kv.runtime.memory.state_file import import_state

    with pytest.raises(RuntimeInputError, match="model must be a path"):
        Session(None)
    with pytest.raises(RuntimeInputError, match="ctx_len .* larger than the largest supported"):
        Session(tiny, ctx_len=2**40)
    with pytest.raises(MemoryLimitError, match="bytes"):
        Session(tiny, ctx_len=int(HUGE_CTX))
    with pytest.raises(RuntimeInputError, match="threads"):
        Session(tiny, threads=-2)
    s = Session(tiny)
    with pytest.raises(RuntimeInputError, match="sampling must be a SamplingParams"):
        s.generate([[1, 2]], sampling="greedy", max_new_tokens=1)
    [g] = s.generate(np.array([1, 2, 3]), max_new_tokens=2)  # a numpy array is a prompt like a list
    assert len(g.tokens) == 2
    s.remove_sequence(g.sequence)
    with pytest.raises(RuntimeInputError, match="prompts"):
        s.generate(7, max_new_tokens=1)
    with pytest.raises(StateFileError, match="needs a path"):
        s.load_state(None)
    with pytest.raises(StateFileError, match="needs a path"):
        load_state(s, None)
    with pytest.raises(StateFileError, match="expected a KVState"):
        import_state(s, {"tensors": {}, "metadata": {}})
    with pytest.raises(StateFileError, match="expected a KVState"):
        s.import_state({})
    fresh = s.add_sequence()
    with pytest.raises(RuntimeInputError, match="empty: prefill it first"):
        s.decode({fresh: 5})
    assert fresh.length == 0
    with pytest.raises(RuntimeInputError, match="expected a Sequence"):
        s.decode({"seq": 5})


def test_memory_requests_are_checked_first():
    with pytest.raises(MemoryLimitError) as ei:
        limits.require_memory(2**70, "a test buffer")
    msg = str(ei.value)
    assert "a test buffer" in msg and str(2**70) in msg and "\n" not in msg
    limits.require_memory(1, "one byte")  # fits
    n = limits.kv_buffer_bytes([(2, 16), (2, 16)], ctx_len=2**31 - 1, batch=4, itemsize=4, copies=2)
    assert n == 2 * 2 * 16 * 4 * (2**31 - 1) * 4 * 2


def test_positive_int_bounds():
    assert limits.positive_int("x", 5) == 5
    for bad in (0, -1, True, 2.0, "3", 2**31, None):
        with pytest.raises(QeffKvError):
            limits.positive_int("x", bad)


# ================================================================================================ leftovers
@requires_torch
def test_stale_staging_folders_removed_by_next_export(tmp_path):
    from qeff_kv.export import export_model

    old = tmp_path / ".killed.export-abc123"
    (old / "stage").mkdir(parents=True)
    (old / "stage" / "model.onnx").write_bytes(b"half")
    fresh = tmp_path / ".running.export-def456"
    fresh.mkdir()
    two_days = time.time() - 2 * 86400
    os.utime(old, (two_days, two_days))
    export_model(None, tmp_path / "m", verify=False)
    assert not old.exists()
    assert fresh.exists()  # may belong to an export running now
    assert (tmp_path / "m" / "manifest.json").is_file()


# ================================================================================================ properties
def _ints():
    return st.one_of(st.integers(-5, 300),
                     st.sampled_from([0, -1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, -2**63, 10**30]))


def _odd_text():
    return st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)


def _values():
    return st.one_of(_ints().map(str), _odd_text(), st.floats(allow_nan=True).map(str))


@pytest.fixture
def arena(tmp_path, monkeypatch, graph, dup_graph):
    """A working folder with odd paths in it; the test runs inside it so any relative path lands there."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "garbage.onnx").write_bytes(b"not onnx")
    shutil.copy(graph, tmp_path / "g.onnx")
    shutil.copy(dup_graph, tmp_path / "dup.onnx")
    monkeypatch.chdir(tmp_path)
    return tmp_path


_PATHS = ["g.onnx", "dup.onnx", "garbage.onnx", "file", "dir", "fifo", "file/below", "missing/x.onnx", "", "-",
          "out/new.onnx", "é ü/…", "/dev/null"]


def _paths():
    return st.one_of(st.sampled_from(_PATHS), _odd_text().map(lambda s: "p_" + s.replace("/", "_")))


def _contract(res, allowed=(0,)):
    assert "Traceback" not in res.output, res.output
    if res.exit_code in allowed:
        return
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr


def _opts(spec: dict[str, st.SearchStrategy]):
    """A random subset of options, each with a random value."""
    return st.lists(st.sampled_from(sorted(spec)), max_size=4, unique=True).flatmap(
        lambda names: st.tuples(*[st.tuples(st.just(n), spec[n]) for n in names]) if names else st.just(()))


def _argv(pairs) -> list[str]:
    out = []
    for name, value in pairs:
        out += [name] if value is None else [name, value]
    return out


def _settings(n: int):
    return settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                    database=None)


@_settings(40)
@given(model=_paths(), out=_paths(), opts=_opts({
    "--kv-cache-prefix": _odd_text(), "--strip-prefix": st.none(), "--in-place": st.none(), "--json": st.none(),
    "--allow-mixed-prefixes": st.none()}))
def test_property_rewrite(arena, model, out, opts):
    _contract(cli("rewrite", model, "-o", out, *_argv(opts)))
    assert stat.S_ISFIFO((arena / "fifo").lstat().st_mode) and (arena / "file").read_text() == "x"


@_settings(30)
@given(models=st.lists(_paths(), min_size=1, max_size=2), opts=_opts({
    "--kv-cache-prefix": _odd_text(), "--no-kv-cache-prefix": st.none(), "--json": st.none(),
    "--skip-onnx-checker": st.none()}))
def test_property_check(arena, models, opts):
    _contract(cli("check", *models, *_argv(opts)), allowed=(0, 1))


@_settings(30)
@given(model=_paths(), opts=_opts({"--regex": _odd_text(), "--ctx-len": _ints().map(str), "--json": st.none(),
                                   "--sliding-window": _ints().map(str)}))
def test_property_buffers(arena, model, opts):
    _contract(cli("buffers", model, *_argv(opts)))


@_settings(40)
@given(model=st.sampled_from(["g.onnx", "dup.onnx", "garbage.onnx", "missing.onnx", "file"]), out=_paths(),
       ctx=_values(), pre=_values(), opts=_opts({
           "--batch-size": _values(), "--full-batch-size": _values(), "--precision": _odd_text(),
           "--specializations-format": _odd_text(), "--sliding-window": _values()}))
def test_property_compile_config(arena, model, out, ctx, pre, opts):
    res = cli("compile-config", model, "-o", out, "--ctx-len", ctx, "--prefill-seq-len", pre, *_argv(opts))
    _contract(res)
    if res.exit_code == 0:
        spec = json.loads((arena / out / "specializations.json").read_text())
        for s in spec["specializations"]:
            for v in (s.get("symbols") or s).values():
                assert 1 <= int(v) <= limits.MAX_DIM


@requires_torch
@_settings(30)
@given(model=st.sampled_from(["TINY", "TINYCB", "g.onnx", "garbage.onnx", "dir", "missing"]),
       prompt=st.one_of(_odd_text(), _ints().map(str), st.lists(st.integers(-3, 300), min_size=1, max_size=5).map(
           lambda xs: ",".join(map(str, xs)))),
       opts=_opts({"--max-new-tokens": st.one_of(st.integers(0, 8).map(str), _values()),
                   "--ctx-len": st.one_of(st.integers(1, 300).map(str), _values()),
                   "--prefill-seq-len": _values(), "--max-sequences": _values(), "--temperature": _values(),
                   "--top-k": _values(), "--top-p": _values(), "--seed": _values(), "--threads": _values(),
                   "--stop-token": _values(), "--on-capacity": st.sampled_from(["stop", "error", "x"]),
                   "--select": _odd_text(), "--save-state": _paths(), "--load-state": _paths(), "--json": st.none(),
                   "--no-inplace": st.none(), "--ignore-eos": st.none()}))
def test_property_generate(arena, tiny, tiny_cb, model, prompt, opts):
    model = {"TINY": str(tiny), "TINYCB": str(tiny_cb)}.get(model, model)
    _contract(cli("generate", model, "--prompt-ids", prompt, *_argv(opts)))
    assert stat.S_ISFIFO((arena / "fifo").lstat().st_mode) and (arena / "file").read_text() == "x"


@requires_torch
@_settings(5)
@given(opts=_opts({"--ctx-len": _values(), "--prefill-seq-len": _values(), "--kv-cache-prefix": _odd_text(),
                   "--full-batch-size": _values(), "--continuous-batching": st.none(),
                   "--dtype": st.sampled_from(["float32", "float16", "int3"]),
                   "--target": st.sampled_from(["portable", "onnxruntime", "nope"])}),
       out=_paths())
@example(opts=(("--ctx-len", "64"), ("--prefill-seq-len", "16")), out="out/e")  # one that succeeds
def test_property_export(arena, opts, out):
    _contract(cli("export", "-q", "--no-verify", "-o", out, *_argv(opts)))

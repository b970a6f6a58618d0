"""Survey (not a test): export each family of tests/helpers/families.py on each target and compare greedy tokens with transformers.

Usage: .venv/bin/python tests/helpers/survey_families.py [all|name,name] [target,target]
"""
import sys, tempfile, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from families import FAMILIES, make_family_dir, TARGETS
from hf_models import hf_greedy, PlainLoop
from qeff_kv.export import export_model
names = sys.argv[1].split(",") if len(sys.argv) > 1 and sys.argv[1] != "all" else list(FAMILIES)
targets = sys.argv[2].split(",") if len(sys.argv) > 2 else list(TARGETS)
root = Path(tempfile.mkdtemp())
PROMPTS = [[5, 17, 42, 99, 13, 7, 101, 64, 3, 77, 21], [100, 3, 3, 60, 9]]
for name in names:
    try:
        d = make_family_dir(name, root)
    except Exception as e:
        print(f"{name:20s} BUILD-FAIL {type(e).__name__}: {str(e).splitlines()[0][:150]}"); continue
    refs = [hf_greedy(d, p, 8) for p in PROMPTS]
    for t in targets:
        t0 = time.time()
        try:
            r = export_model(d, root / f"{name}-{t}", ctx_len=32, prefill_seq_len=4, target=t)
            got = [PlainLoop(r.onnx_path, 32).greedy(p, 8, 4) for p in PROMPTS]
            status = "exact" if got == refs else f"MISMATCH got={got} ref={refs}"
        except Exception as e:
            status = f"FAIL {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        print(f"{name:20s} {t:18s} {status}  ({time.time()-t0:.1f}s)", flush=True)

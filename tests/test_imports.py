"""What a capture imports. torch's compiler (``torch._dynamo``) and its distributed tensors
(``torch.distributed.tensor``) cost seconds on a CUDA machine and a capture runs neither. attnviz imports
neither itself, on the CPU or the CUDA path (the fused kernel's Triton modules included): the only importer
is transformers' modelling code, which every model load needs (docs/gpu.md#start-up). This test names the
importer, so a change in attnviz that pulls either in fails here."""

import json
import subprocess
import sys

HEAVY = ("torch._dynamo", "torch.distributed.tensor")

FINDER = """
import json, sys, traceback

first = {}

class Watch:
    def find_spec(self, name, path=None, target=None):
        if name in %r and name not in first:
            frames = [f.filename for f in traceback.extract_stack()[:-1]]
            outside = [f for f in frames if "importlib" not in f and "/torch/" not in f and f != "<string>"]
            first[name] = outside[-1] if outside else "?"
        return None

sys.meta_path.insert(0, Watch())
""" % (HEAVY,)


def _first_importers(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", FINDER + code + "\nprint('FIRST', json.dumps(first))"],
                         capture_output=True, text=True, timeout=600, cwd="tests")
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.split("FIRST", 1)[1])


def test_a_capture_imports_torchs_compiler_and_distributed_tensors_only_through_transformers():
    first = _first_importers("from tiny import loaded\nfrom attnviz import Keep, capture\n"
                             "capture(loaded('llama'), 'The keeper lit the lamp.', 'fwd', Keep(statistics=True, pool=8))")
    for name in HEAVY:
        if name in first:
            assert "/transformers/" in first[name] and "/attnviz/" not in first[name], (name, first[name])


def test_the_fused_kernels_modules_import_neither():
    first = _first_importers("import torch\nfrom attnviz.core.kernel import kernels\nkernels.available()\n"
                             "import attnviz.core.kernel._triton_stats\n")
    assert not set(first) & set(HEAVY), first

"""The benchmarks run on whatever device the model is on: no bench makes a tensor on the CPU for a model that may be
on a GPU (bench/scan.py's plain forward did: "index is on cpu, different from other tensors on cuda:0"), the shared
helpers put ids on the model's device, and bench/scan.py and every other bench that times a model run end to end on
a saved model (on CUDA where there is one: the tests marked ``cuda``)."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tiny

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))
MADE_HERE = {"tensor", "zeros", "ones", "arange", "full", "empty", "randn", "rand", "randint"}
OWN_DEVICE = {"common.py", "gpu.py", "kernel_regs.py"}  # the helpers, and the GPU benches that place every tensor
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
#: (bench, tiny arguments, how its last line starts, a field that line holds), for each bench that takes --model
#: (bench/scan.py has its own test)
MODEL_BENCHES = [
    ("capture.py", ["--n", "48", "--repeat", "1"], "capture_all_vs_eager N=48 ", "time_ratio="),
    ("command.py", ["--n", "48", "--repeat", "1"], "command n=", "ratio="),
    ("effects.py", ["--eval-tokens", "48", "--window", "24", "--stream-tokens", "8", "--repeat", "1"], "effects ",
     "eval_ratio="),
    ("explain.py", ["--n", "48", "--repeat", "1"], "explain n=", "cell_ratio="),
    ("long.py", ["--n", "48", "--repeat", "1"], "long n=", "time_ratio="),
    ("region.py", ["--n", "48", "--repeat", "1"], "region n=", "speedup="),
    ("routes.py", ["--n", "40", "--repeat", "1"], "routes n=40 ", "ratio="),
]
TAKE_DEVICE = {"capture.py", "routes.py"}  # the benches with a --device of their own; the others read ATTNVIZ_DEVICE


def test_no_bench_makes_a_tensor_without_naming_its_device():
    offenders = []
    for path in sorted(BENCH.glob("*.py")):
        if path.name in OWN_DEVICE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MADE_HERE
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                    and not any(k.arg == "device" for k in node.keywords)):
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, f"tensors made on the CPU whatever the model's device (use common.ids_on): {offenders}"


def test_ids_land_on_the_model_s_device():
    from common import ids_on, timed

    model = tiny.build("llama").to("meta")  # stands for a GPU: not the CPU
    one, batch = ids_on(model, [1, 2, 3]), ids_on(model, [[1, 2], [3, 4]])
    assert one.device.type == batch.device.type == "meta" and one.shape == (1, 3) and batch.shape == (2, 2)
    assert one.dtype == torch.long
    assert timed(model, lambda: None) >= 0


@pytest.mark.parametrize("device", DEVICES)
def test_the_scan_bench_runs_on_the_model_s_device(device, model_cache, tmp_path):
    where = tmp_path / "tiny-llama"
    tiny.build("llama").save_pretrained(where)
    tiny.char_tokenizer().save_pretrained(where)
    out = subprocess.run([sys.executable, str(BENCH / "scan.py"), "--model", str(where), "--n", "60", "--repeat", "1",
                          "--device", device], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("scan ") and f"device={device}" in last and "ratio=" in last


@pytest.fixture(scope="module")
def saved_llama(model_cache, tmp_path_factory):
    """A tiny Llama saved as a model folder, once for the module. Its character tokenizer decodes without a space
    between tokens, so that a text decoded from N tokens tokenizes back to N tokens (bench/capture.py checks it)."""
    from tokenizers import decoders

    where = tmp_path_factory.mktemp("benches") / "tiny-llama"
    tiny.build("llama").save_pretrained(where)
    tokenizer = tiny.char_tokenizer()
    tokenizer.backend_tokenizer.decoder = decoders.Fuse()
    tokenizer.save_pretrained(where)
    return where


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bench,arguments,start,field", MODEL_BENCHES, ids=[row[0] for row in MODEL_BENCHES])
def test_every_model_bench_runs_end_to_end_on_a_saved_model(bench, arguments, start, field, device, saved_llama):
    """A GPU machine has no default model, only a saved one (bench/random_model.py): each bench loads the model it
    is given, in each process it starts, on the device asked for, and shapes its run to that model's layers."""
    command = [sys.executable, str(BENCH / bench), "--model", str(saved_llama), *arguments]
    if bench in TAKE_DEVICE:
        command += ["--device", device]
    out = subprocess.run(command, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "ATTNVIZ_DEVICE": device})
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith(start) and field in last, out.stdout[-2000:]


def test_a_gpu_s_host_dispatches_a_bounded_few_operations_for_each_recorded_layer():
    """bench/host.py's count of what a GPU's host does for a statistics capture on the fused route: each recorded
    layer beyond the first adds at most 25 operations (about 20: the attention kernel, the statistics kernel's launch
    and the tensors it is handed) and no copy to the host, since fused layers are finished and copied together
    (attnviz.core.record.reduce.FusedLayers; finishing each layer alone added about 77 operations and two copies a
    layer). A count, not a time: docs/gpu.md#the-hosts-share-measured-on-a-cpu."""
    import gpu
    import host

    from attnviz.capture import capture
    from attnviz.plan import Keep

    lm = gpu.build("tiny", "cpu", torch.bfloat16)
    text, _ = gpu.text_of(lm, 16)
    with torch.no_grad():
        capture(lm, text, "fwd", Keep(statistics=True, pool=512))  # the model's anatomy is probed once, here
        every = host.count(lambda: capture(lm, text, "fwd", Keep(statistics=True, pool=512)))
        one = host.count(lambda: capture(lm, text, "fwd", Keep(statistics=True, pool=512, layers=[0])))
    layers = lm.model.config.num_hidden_layers
    assert every["launches"] == layers and one["launches"] == 1  # every recorded layer took the fused route
    assert (every["ops"] - one["ops"]) / (layers - 1) <= 25, (every, one)
    assert every["copies"] == one["copies"] <= 3 and every["waits"] == 0
    line = host.measure("tiny", 16, 1, "bfloat16")  # the bench's own line
    assert line.startswith("host shape=tiny n=16 ") and "host_ratio=" in line and "capture_copies=3 " in line
    assert "extra_mb_per_layer=" in line


def test_the_bytes_an_operation_writes_count_new_and_mutated_tensors_not_views():
    """common.dispatch_counter's ``written``: a new tensor's bytes and an in-place operation's output count; a view,
    and a conversion to the dtype a tensor already has (no operation at all), add nothing. Under inference mode (how
    attnviz runs a forward) a conversion and a ``contiguous`` that copy reach the dispatcher as operations whose
    schema allows a view: they count all the same."""
    import common

    x = torch.ones(1000)
    with common.dispatch_counter() as counted:
        fresh = torch.zeros(1000)  # 4,000 bytes
        fresh.view(10, 100), fresh[:10], fresh.unsqueeze(0)  # views: nothing written
        fresh.add_(x)  # in place: 4,000
        fresh.to(torch.float16)  # 2,000
        fresh.to(torch.float32)  # the same dtype: not dispatched
        torch.stack([fresh, x])  # 8,000
    assert counted.written == 4000 + 4000 + 2000 + 8000
    with torch.inference_mode(), common.dispatch_counter() as counted:
        fresh = torch.zeros(1000)  # 4,000 bytes
        fresh.to(torch.float16), fresh.to(torch.float32)  # 2,000; the same dtype: itself
        fresh.view(10, 100).t().contiguous(), fresh.view(10, 100).contiguous()  # a copy: 4,000; itself
    assert counted.written == 4000 + 2000 + 4000
    with common.dispatch_counter() as counted:
        torch.empty(8, 8, device="meta").transpose(0, 1)  # a meta tensor: its size, no memory; then a view
    assert counted.written == 8 * 8 * 4


def test_what_a_statistics_capture_writes_beyond_sdpa_grows_with_the_tokens_not_their_square():
    """bench/host.py's bytes a layer beyond SDPA's, for a capture on the fused route (16-cell maps, a 4-layer model):
    the kernel's outputs, the keys and values repeated to every head for the attention kernel and the statistics'
    finishing are each a few vectors of a head's tokens, so doubling the tokens at most doubles them. Anything of
    a layer's n x n (a copy of its scores or probabilities, a map finished at full size) would quadruple; at 128
    tokens one such float32 copy is 256 KB a layer, beside the about 150 KB written now."""
    import gpu
    import host

    from attnviz.capture import capture
    from attnviz.plan import Keep

    lm = gpu.build("tiny", "cpu", torch.bfloat16)
    keep = Keep(statistics=True, pool=16)
    extra = {}
    with torch.no_grad():
        for n in (128, 256):
            text, ids = gpu.text_of(lm, n)
            capture(lm, text, "fwd", keep)
            cap = host.count(lambda: capture(lm, text, "fwd", keep))
            base = host.count(lambda: gpu.stock(lm, "sdpa", ids))
            extra[n] = (cap["written"] - base["written"]) / lm.model.config.num_hidden_layers
    repeated = 2 * 4 * 128 * 16 * 2  # keys and values, 4 heads, 128 tokens, head dim 16, bfloat16
    assert repeated < extra[128] and extra[256] <= 2.1 * extra[128], extra


def test_the_lab_benches_time_every_kind_against_the_stock_loops():
    """bench/lab_step.py times every kind the lab trains against its family's stock loop and the stock softmax loop
    (gpt-oss's eager: it has no SDPA), in one run; bench/lab_sink.py runs the learned sink too, with both baselines."""
    out = subprocess.run([sys.executable, str(BENCH / "lab_step.py"), "--steps", "2", "--warmup", "1", "--width", "16",
                          "--heads", "2", "--batch", "2", "--length", "12"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    kinds = {line.split()[1] for line in lines if line.startswith("lab_step kind=")}
    assert kinds >= {f"kind={k}" for k in ("softmax", "sink(logit=0)", "sink", "softpick", "sigmoid", "gate")}
    assert "stock=gpt_oss/eager" in next(line for line in lines if "kind=sink " in line)
    assert lines[-1].startswith(f"lab_step kinds={len(kinds)} stock_mlps=run ") and "worst_ratio_softmax=" in lines[-1]
    out = subprocess.run([sys.executable, str(BENCH / "lab_sink.py"), "--kind", "sink", "--steps", "2", "--probe", "2",
                          "--baseline-steps", "2"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("lab_sink steps=2 ") and "baseline=gpt_oss/eager" in last and "ratio_softmax=" in last


def test_the_stock_loop_runs_its_zero_mlps_unless_asked_to_skip_them_as_the_lab_does(monkeypatch):
    """The lab writes an attention-only model's zero MLP output without running the MLP; the stock loop of
    bench/lab_step.py runs it, as plain transformers does, unless ``--stock-mlps skip``."""
    monkeypatch.syspath_prepend(str(BENCH))
    import lab_step

    from attnviz.lab.tasks import BigramBackcopy
    from attnviz.lab.train import Setup

    for kind in ("softmax", "sink"):
        setup = Setup(kind=kind, width=16, heads=2, batch=2, device="cpu", task=BigramBackcopy(length=12))
        ran = lab_step.stock_loop(setup)[1].model.layers[0].mlp
        skipped = lab_step.stock_loop(setup, "skip")[1].model.layers[0].mlp
        assert "forward" not in vars(ran) and "forward" in vars(skipped)

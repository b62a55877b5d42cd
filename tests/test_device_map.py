"""A model larger than one device, loaded through accelerate's device map: some layers on
the CPU, others offloaded to disk, gives the same statistics as a plain load."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from attnviz import Keep, capture, load
from attnviz.errors import ModelLoadError

TEXT = "The keeper climbed the stairs, lit the lamp, and watched the ships pass the rocks all night."


@pytest.fixture(scope="module")
def model_dir(default_model, tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("models") / "four-layers"
    config = LlamaConfig(vocab_size=len(default_model.tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    default_model.tokenizer.save_pretrained(path)
    return path


MAP = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "cpu",
       "model.layers.3": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}


@pytest.mark.parametrize("arch", ["fwd", "mask0-bidir(k=2)", "stablemask(gamma=0.5)"])
def test_cpu_and_disk_offload_give_the_statistics_of_a_plain_load(model_dir, tmp_path, arch):
    plain = load(str(model_dir))
    mapped = load(str(model_dir), device_map=MAP, offload_folder=tmp_path / "offload")
    assert mapped.model.hf_device_map["model.layers.1"] == "disk"
    layers = mapped.model.model.layers  # disk layers hold no weights until accelerate's hook loads them
    assert layers[1].self_attn.q_proj.weight.device.type == "meta" and layers[0].self_attn.q_proj.weight.device.type == "cpu"
    keep = Keep(statistics=True, pool=8, value_norms=True, block_bytes=4 * 4 * 30 * 5)  # several blocks a layer
    a, b = capture(plain, TEXT, arch, keep), capture(mapped, TEXT, arch, keep)
    assert a.layers == b.layers == [0, 1, 2, 3]
    for layer in a.layers:
        for name, value in a.stats[layer].items():
            np.testing.assert_allclose(b.stats[layer][name].astype(np.float32), value.astype(np.float32),
                                       atol=1e-5, equal_nan=True, err_msg=f"{name} L{layer}")
    np.testing.assert_allclose(b.next_logprobs, a.next_logprobs, atol=1e-4)
    full_a, full_b = capture(plain, TEXT, arch), capture(mapped, TEXT, arch)
    for layer in full_a.layers:
        np.testing.assert_allclose(full_b.layer_probs(layer), full_a.layer_probs(layer), atol=1e-3)


def test_a_bad_device_map_is_one_clear_error(model_dir):
    with pytest.raises(ModelLoadError, match="device map"):
        load(str(model_dir), device_map="nowhere")
    with pytest.raises(ModelLoadError, match="either a device or a device map"):
        load(str(model_dir), device="cpu", device_map="auto")


def test_cli_device_map_auto(model_dir):
    out = subprocess.run([sys.executable, "-m", "attnviz", "sinks", "--model", str(model_dir), "--device-map", "auto",
                          "--text", TEXT, "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert len(doc["layers"]) == 4
    bad = subprocess.run([sys.executable, "-m", "attnviz", "sinks", "--model", str(model_dir), "--device-map",
                          "nowhere", "--text", TEXT], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "device map" in bad.stderr


def test_where_a_mapped_model_runs_is_said_in_one_line(model_dir, tmp_path):
    from attnviz.core.model import devices

    mapped = load(str(model_dir), device_map=MAP, offload_folder=tmp_path / "offload")
    assert devices.describe(mapped.model) == "cpu + disk · float32"
    assert devices.describe(load(str(model_dir)).model) == "cpu · float32"


def test_a_model_mapped_to_the_cpu_and_disk_loads_in_float32_on_a_gpu_machine_too(model_dir, tmp_path, monkeypatch):
    """Where a mapped model runs decides its dtype: the CPU and disk mean float32, whether or not the machine
    has a GPU (simulated here: torch says CUDA is available, and the map never touches it)."""
    from attnviz.core.model import devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert devices.mapped_device(MAP) == "cpu" and devices.mapped_device("auto") == "cuda"
    mapped = load(str(model_dir), device_map=MAP, offload_folder=tmp_path / "offload")
    assert mapped.model.dtype == torch.float32
    assert devices.describe(mapped.model) == "cpu + disk · float32"

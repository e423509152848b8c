"""int4 checkpoints in the GPTQ layout (``minifer.quantization.gptq_layout``, ``minifer.model_loader.gptq``).

The layout is checked against a reference unpacking written here, bit by bit, from the published format
(AutoGPTQ's ``QuantLinear``, read by vLLM and transformers/GPTQModel): ``qweight`` int32 ``[K/8, N]`` with input
``8r + j`` of word ``r`` in bits ``4j..4j+3``; ``qzeros`` int32 ``[K/g, N/8]`` with output ``8c + j`` in bits
``4j..4j+3``, stored minus one in checkpoint format v1 ("gptq"), as is in v2; ``scales`` float16 ``[K/g, N]``;
``g_idx`` int32 ``[K]``; ``w[k, n] = scales[g_idx[k], n] * (code[k, n] - zero[g_idx[k], n])``. It shares no
code with the module it checks. Loading through transformers runs only where GPTQModel is installed; on a CPU,
in a venv that keeps the project's torch (GPTQModel 7.6 builds no extension there):

    python -m venv --system-site-packages /tmp/venv-gptq
    echo "torch==$(python -c 'import torch; print(torch.__version__)')" > /tmp/keep-torch.txt
    /tmp/venv-gptq/bin/pip install gptqmodel==7.6.0 optimum -c /tmp/keep-torch.txt
    PYTHONPATH=$PWD /tmp/venv-gptq/bin/python -m pytest tests/quant/test_gptq_export.py
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

import minifer
from conftest import REPO, minifer_forward
from minifer.eval import greedy_continuations
from minifer.model_loader import ModelLoadError
from minifer.compress.gptq_export import save_gptq, to_gptq
from minifer.model_loader.gptq import load_gptq
from minifer.model_loader.quantized import is_gptq_checkpoint
from minifer.quantization.formats import QuantizedWeight, dequantize, quantize_int4
from minifer.quantization.gptq_layout import from_gptq
from minifer.quantization.linear import decoder_linears
from minifer.compress import gptq_quantize_model
from minifer.quantization.model import quantize_model


def reference_dequantize(t: dict[str, torch.Tensor], v1: bool) -> np.ndarray:
    """``W [N, K]`` (float64) from GPTQ tensors, one element at a time, straight from the format's definition."""
    qweight = t["qweight"].numpy().view(np.uint32)  # the bits as stored; int32's sign is bit 31
    qzeros = t["qzeros"].numpy().view(np.uint32)
    scales = t["scales"].numpy().astype(np.float64)
    g_idx = t["g_idx"].numpy()
    k_dim, n_dim = qweight.shape[0] * 8, qweight.shape[1]
    w = np.zeros((n_dim, k_dim))
    for k in range(k_dim):
        g = int(g_idx[k])
        for n in range(n_dim):
            code = (int(qweight[k // 8, n]) >> (4 * (k % 8))) & 0xF
            zero = ((int(qzeros[g, n // 8]) >> (4 * (n % 8))) & 0xF) + (1 if v1 else 0)
            w[n, k] = scales[g, n] * (code - zero)
    return w


def with_fp16_scales(qw: QuantizedWeight) -> QuantizedWeight:
    return QuantizedWeight(qw.fmt, qw.qweight, qw.scales.half().float(), qw.zeros, qw.group_size, qw.shape)


# Odd shapes: N and K multiples of 8 but not of 16 or 32 where possible, groups from 8 to all of K.
SHAPES = [(40, 96, 32, True, "gptq"), (24, 200, 8, False, "gptq_v2"), (56, 48, 16, False, "gptq"),
          (8, 72, 72, True, "gptq_v2"), (104, 120, 40, False, "gptq")]


@pytest.mark.parametrize("n,k,g,symmetric,fmt", SHAPES)
def test_layout_matches_the_reference_unpacking(n, k, g, symmetric, fmt):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) - 0.3 * (not symmetric)
    qw = quantize_int4(w, g, symmetric)
    t = to_gptq(qw, checkpoint_format=fmt)
    assert {name: (tuple(x.shape), x.dtype) for name, x in t.items()} == {
        "qweight": ((k // 8, n), torch.int32), "qzeros": ((k // g, n // 8), torch.int32),
        "scales": ((k // g, n), torch.float16), "g_idx": ((k,), torch.int32)}
    ref = reference_dequantize(t, v1=fmt == "gptq")
    assert np.array_equal(ref.astype(np.float32), dequantize(with_fp16_scales(qw)).numpy())
    back = from_gptq(t, g, symmetric, fmt)
    assert torch.equal(back.qweight, qw.qweight) and torch.equal(back.scales, with_fp16_scales(qw).scales)
    assert (back.zeros is None) == symmetric and (symmetric or torch.equal(back.zeros, qw.zeros))


def test_symmetric_zero_points_are_the_v1_constant():
    """Symmetric int4 has zero point 8: stored 7 in every nibble of v1, 8 in v2 (the format's trap)."""
    qw = quantize_int4(torch.randn(16, 64), 32)
    assert (to_gptq(qw)["qzeros"] == 0x77777777).all()
    assert (to_gptq(qw, checkpoint_format="gptq_v2")["qzeros"] == 0x88888888 - 2**32).all()  # bit 31 set


def test_a_smaller_checkpoint_group_is_exact():
    """A g64 layer written as g32 (the checkpoint's single group size): two groups with equal scales."""
    qw = quantize_int4(torch.randn(16, 128), 64, symmetric=False)
    t = to_gptq(qw, group_size=32)
    assert t["scales"].shape == (4, 16) and torch.equal(t["scales"][0], t["scales"][1])
    assert np.array_equal(reference_dequantize(t, v1=True).astype(np.float32),
                          dequantize(with_fp16_scales(qw)).numpy())
    with pytest.raises(ValueError, match="does not divide the weight's own group"):
        to_gptq(qw, group_size=48)


def test_zero_point_zero_needs_v2():
    w = torch.randn(8, 32)
    w[:, :16] = w[:, :16].abs()  # an all-positive group: its range widened to 0 gives zero point 0
    qw = quantize_int4(w, 16, symmetric=False)
    assert int(qw.zeros.min()) == 0
    with pytest.raises(ValueError, match="zero point 0.*gptq_v2"):
        to_gptq(qw)
    t = to_gptq(qw, checkpoint_format="gptq_v2")
    assert np.array_equal(reference_dequantize(t, v1=False).astype(np.float32),
                          dequantize(with_fp16_scales(qw)).numpy())


def test_what_the_layout_cannot_hold_is_refused():
    with pytest.raises(ValueError, match=r"multiples of 8; this layer is \[N=12, K=64\]"):
        to_gptq(quantize_int4(torch.randn(12, 64), 32))
    with pytest.raises(ValueError, match="only int4"):
        to_gptq(QuantizedWeight("int8", torch.zeros(8, 8, dtype=torch.int8), torch.ones(8), None, None, (8, 8)))
    with pytest.raises(ValueError, match="float16's range"):
        to_gptq(quantize_int4(torch.randn(8, 32) * 1e6, 16))
    t = to_gptq(quantize_int4(torch.randn(8, 64), 32))
    t["g_idx"] = t["g_idx"].flip(0)  # an act-order checkpoint's permuted groups
    with pytest.raises(ValueError, match="g_idx is not k // group_size"):
        from_gptq(t, 32, True)
    t = to_gptq(quantize_int4(torch.randn(8, 64), 32, symmetric=False), checkpoint_format="gptq_v2")
    with pytest.raises(ValueError, match="sym=true but the zero points"):
        from_gptq(t, 32, True, "gptq_v2")


# --- checkpoints ------------------------------------------------------------------------------------------


def test_llm_loads_its_gptq_checkpoint_with_the_same_greedy_tokens(target_llm, tmp_path):
    """The bundled target, int4 g128 (g64 where 128 does not divide K): saved in the GPTQ layout, loaded back by
    ``LLM(path)``, it gives the in-memory model's greedy tokens; its weights are the in-memory ones with scales
    rounded to float16, exactly."""
    model = copy.deepcopy(target_llm.model)
    quantize_model(model, "int4")
    save_gptq(model, tmp_path, source=target_llm.model_path)
    assert is_gptq_checkpoint(tmp_path) and not (tmp_path / "quantization_config.json").exists()
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format")} == {
        "quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq"}
    llm = minifer.LLM(str(tmp_path), dtype="float32", device="cpu", batching="static")
    assert llm.quantization_config.format == "int4" and len(llm.quantization_config.layers) == 48
    mine = decoder_linears(model)
    for name, lin in decoder_linears(llm.model).items():
        assert torch.equal(dequantize(lin.quantized_weight), dequantize(with_fp16_scales(mine[name].quantized_weight)))
    ids = torch.arange(3, 43).view(2, 20)
    assert torch.equal(greedy_continuations(llm.model, ids, 12), greedy_continuations(model, ids, 12))


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_biases_and_tied_embeddings_round_trip(tiny_checkpoint, tmp_path, fmt):
    """Qwen2 (q/k/v biases, split back out of the fused qkv_proj, and tied embeddings), asymmetric, GPTQ-calibrated."""
    _, folder = tiny_checkpoint("qwen2")
    llm = minifer.LLM(str(folder), device="cpu")
    calib = torch.randint(0, 97, (4, 24), generator=torch.Generator().manual_seed(0))
    gptq_quantize_model(llm.model, "int4", group_size=16, symmetric=False, calib_data=calib)
    save_gptq(llm, tmp_path, checkpoint_format=fmt)
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"model.layers.0.self_attn.k_proj.bias", "model.layers.1.mlp.up_proj.qzeros"} <= names
    assert "lm_head.weight" not in names and not any("qkv_proj" in n or "gate_up" in n for n in names)
    loaded = load_gptq(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert loaded.quantization_config.method == "gptq" and not loaded.quantization_config.symmetric
    ids = torch.arange(30).view(2, 15)
    assert torch.equal(greedy_continuations(loaded, ids, 6), greedy_continuations(llm.model, ids, 6))


def test_gptq_checkpoint_errors(tiny_checkpoint, tmp_path):
    _, folder = tiny_checkpoint("llama")
    llm = minifer.LLM(str(folder), device="cpu", quantization="int8")
    with pytest.raises(ValueError, match="save_gptq writes int4 models; this one is int8"):
        save_gptq(llm, tmp_path)
    llm = minifer.LLM(str(folder), device="cpu", quantization="int4")
    save_gptq(llm, tmp_path)
    with pytest.raises(ValueError, match="holds a int4 checkpoint"):
        minifer.LLM(str(tmp_path), device="cpu", quantization="int8")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"].update(bits=8, checkpoint_format="marlin")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"bits=8 .*checkpoint_format='marlin'"):
        load_gptq(tmp_path)


QWEN2_64 = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}  # K divisible by GPTQModel's g32


def _hf_logit_error(folder, ids, mine) -> float:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), device_map="cpu").eval()
    assert hasattr(hf.model.layers[0].self_attn.q_proj, "qweight"), "transformers did not load the GPTQ layers"
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0].float()
    return float((mine - theirs).abs().max() / theirs.abs().max())


@pytest.mark.parametrize("kind,symmetric,fmt,overrides", [("llama", True, "gptq", {}), ("llama", False, "gptq", {}),
                                                          ("qwen2", False, "gptq_v2", QWEN2_64),
                                                          ("qwen3", True, "gptq", {})])
def test_transformers_reads_the_checkpoint(tiny_checkpoint, tmp_path, kind, symmetric, fmt, overrides):
    """Where GPTQModel (transformers' GPTQ backend) installs, transformers loads the folder and its logits agree
    with minifer's on the same checkpoint (GPTQModel's CPU kernel multiplies in 16 bits: within 2%; measured
    0.2-0.7%). The control: v2 zero points labelled v1, every zero off by one, is far outside (147% measured)."""
    pytest.importorskip("gptqmodel")
    pytest.importorskip("optimum")
    _, folder = tiny_checkpoint(kind, **overrides)
    llm = minifer.LLM(str(folder), device="cpu")
    quantize_model(llm.model, "int4", group_size=32, symmetric=symmetric)  # GPTQModel's CPU kernel: g32 at least
    save_gptq(llm, tmp_path, checkpoint_format=fmt)
    ids = list(range(3, 23))
    mine = minifer_forward(minifer.LLM(str(tmp_path), device="cpu", batching="static"), ids)
    assert _hf_logit_error(tmp_path, ids, mine) < 2e-2
    if fmt == "gptq_v2":
        cfg = json.loads((tmp_path / "config.json").read_text())
        cfg["quantization_config"]["checkpoint_format"] = "gptq"
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        assert _hf_logit_error(tmp_path, ids, mine) > 0.3


@pytest.mark.slow
def test_minifer_reads_a_checkpoint_gptqmodel_wrote(tmp_path, monkeypatch):
    """The other direction: GPTQModel (the reference writer) quantizes the bundled target on the CPU and saves it;
    minifer's LLM(path) reads it and agrees with transformers' reading of the same folder (measured 0.3-0.5% with
    GPTQModel 7.6, symmetric and asymmetric, against 2.4-3.3% between either and the unquantized model)."""
    monkeypatch.setenv("GPTQMODEL_CPU_WORKERS", "2")  # its model-loader pool asks for 2 CPU workers
    monkeypatch.chdir(tmp_path)  # it writes logs/ into the working directory
    pytest.importorskip("optimum")
    gptqmodel = pytest.importorskip("gptqmodel")
    from transformers import AutoTokenizer

    src = minifer.LLM("tinystories-target", device="cpu", batching="static")
    texts = [t.strip() for t in (REPO / "data" / "tinystories" / "train.txt").read_text().split("<|endoftext|>")]
    model = gptqmodel.GPTQModel.load(str(src.model_path), gptqmodel.QuantizeConfig(bits=4, group_size=32,
                                                                                     desc_act=False, sym=True),
                                     device="cpu")
    model.quantize([t for t in texts if len(t) > 200][:16], batch_size=8)
    folder = tmp_path / "ckpt"
    model.save(str(folder))
    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = tok("Once upon a time, there was a little girl named Lily.")["input_ids"]
    llm = minifer.LLM(str(folder), device="cpu", batching="static")
    assert llm.quantization_config.group_size == 32 and len(llm.quantization_config.layers) == 48
    mine = minifer_forward(llm, ids)
    assert _hf_logit_error(folder, ids, mine) < 2e-2
    base = minifer_forward(src, ids)  # the control: quantization itself moves the logits far more
    assert float((mine - base).abs().max() / base.abs().max()) > 0.01

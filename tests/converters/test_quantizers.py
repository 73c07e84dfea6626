"""RTN, GPTQ and AWQ quantizers and the layer-by-layer calibration driver, on small synthetic shapes."""

from __future__ import annotations

import gc
import json
import weakref
from importlib import resources
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantserve.backends.torch.model import ModelArgs, RotaryEmbedding, Transformer, TransformerBlock
from quantserve.converters.calibration.awq import (
    AWQQuantizer,
    apply_clip,
    apply_scale,
    quantize_awq,
    search_clip,
    search_scale,
)
from quantserve.converters.calibration.awq_block import fold_awq_scales
from quantserve.converters.calibration.driver import (
    DenseTensor,
    QuantizedLinear,
    SafetensorsReader,
    default_calibration_text,
    quantize_model,
    split_tokens,
)
from quantserve.converters.calibration.gptq import GPTQ
from quantserve.converters.calibration.layers import LINEARS
from quantserve.errors import ConfigError
from quantserve.quant.rtn import GroupQuantizer, fake_quantize, quantize_rtn


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _correlated_inputs(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Inputs living mostly in a 12-dim subspace, with uneven channel scales: a Hessian GPTQ can exploit."""
    g = _gen(seed)
    x = torch.randn(n, 12, generator=g) @ torch.randn(12, k, generator=g)
    return (x + 0.1 * torch.randn(n, k, generator=g)) * torch.linspace(0.2, 3.0, k)


def _out_err(w: torch.Tensor, wq: torch.Tensor, x: torch.Tensor) -> float:
    return float(((w - wq) @ x.T).pow(2).sum() / x.shape[0])


# ---- RTN -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sym", [True, False])
def test_rtn_params_match_hand_computation(sym: bool) -> None:
    w = torch.tensor([[0.1, -0.4, 0.3, 0.2, 0.5, 0.6, 0.7, 0.8], [-1.0, -0.5, 0.0, 0.25, 0.0, 0.0, 0.0, 0.0]])
    qw = quantize_rtn(w, bits=4, group_size=4, sym=sym).validate()
    assert qw.qweight.shape == (8, 2) and qw.scales.shape == (2, 2) and qw.scales.dtype == torch.float16
    for row in range(2):
        for grp in range(2):
            x = w[row, 4 * grp : 4 * grp + 4].double()
            xmin, xmax = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
            if sym:
                scale = 2 * max(abs(xmin), xmax) / 15
                if scale == 0:  # the all-zero group: the reference's guard makes the range [-1, 1]
                    scale = 2 / 15
            else:
                if xmin == xmax == 0:
                    xmin, xmax = -1.0, 1.0
                scale = (xmax - xmin) / 15
            s16 = float(torch.tensor(scale).half())
            zero = 8 if sym else round(-xmin / s16)
            q = torch.clamp(torch.round(x / s16) + zero, 0, 15)
            assert float(qw.scales[grp, row]) == s16
            assert int(qw.zero_points()[grp, row]) == zero
            assert torch.equal(qw.qweight[4 * grp : 4 * grp + 4, row].double(), q)
    assert (qw.zeros is None) == sym
    ref = fake_quantize(w, GroupQuantizer(4, sym), 4)
    assert torch.equal(qw.dequantize().T, ref)
    assert bool((qw.dequantize().T[1, 4:] == 0).all())  # zeros stay exactly zero


@pytest.mark.parametrize(
    ("bits", "group_size", "sym"), [(4, 32, True), (4, 32, False), (3, 64, False), (8, -1, True)]
)
def test_rtn_round_trip_error_bound(bits: int, group_size: int, sym: bool) -> None:
    w = torch.randn(48, 128, generator=_gen(1)).to(torch.bfloat16)
    qw = quantize_rtn(w, bits, group_size, sym).validate("w")
    assert qw.group_size == group_size and qw.g_idx is None
    err = (w.float() - qw.dequantize().T).abs()
    step = qw.scales.float()[qw.groups()].T  # [N, K]
    # Half a step, plus clipping at the edge of the range from rounding the scale to fp16 (2^-11 relative).
    assert bool((err <= (0.5 + 2 ** (bits - 1) * 2**-11) * step * 1.0001).all())
    assert float(err.mean()) < 0.3 * float(step.mean())


def test_k_not_multiple_of_group_size_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"K=576 is not a multiple of group_size 128; use --group-size 64"):
        quantize_rtn(torch.randn(8, 576), 4, 128)
    with pytest.raises(ConfigError, match="group_size"):
        GPTQ(100).quantize(torch.randn(4, 100), 4, 64)
    with pytest.raises(ConfigError, match="bits"):
        quantize_rtn(torch.randn(8, 64), 5, 32)


# ---- GPTQ ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_and_dequantizes_exactly(sym: bool, act_order: bool) -> None:
    n, k, bits, g = 1024, 256, 4, 64
    x = _correlated_inputs(n, k)
    w = torch.randn(64, k, generator=_gen(2))
    gptq = GPTQ(k)
    for chunk in x.reshape(8, n // 8, k):  # batches of [128, K] and one [*, T, K] shape
        gptq.add_batch(chunk.reshape(2, -1, k))
    r = gptq.fasterquant(w, bits, g, sym, act_order=act_order, block_size=96)
    assert torch.equal(r.weight.validate().dequantize().T, r.wq)  # exactly the weights GPTQ settled on
    exact = _out_err(w, r.wq, x)
    assert r.loss == pytest.approx(exact, rel=1e-3)  # GPTQ's own error terms give ‖ΔW X‖²/n
    rtn = _out_err(w, quantize_rtn(w, bits, g, sym).dequantize().T, x)
    assert exact < 0.5 * rtn
    assert gptq.H is None  # the Hessian is freed
    if act_order:
        g_idx = r.weight.g_idx
        assert g_idx is not None and g_idx.dtype == torch.int32 and g_idx.shape == (k,)
        assert torch.equal(torch.bincount(g_idx.long()), torch.full((k // g,), g))  # g rows per group
        assert bool((g_idx[1:] < g_idx[:-1]).any())  # not monotone: groups follow diag(H), not i // G
        # The first group holds the inputs with the largest Hessian diagonal (the act-order permutation).
        top = torch.argsort((x * x).sum(0), descending=True)[:g]
        assert set(top.tolist()) == set(torch.nonzero(g_idx == 0).flatten().tolist())
    else:
        assert r.weight.g_idx is None


@pytest.mark.parametrize("act_order", [False, True])
def test_one_sweep_over_linears_of_one_input_equals_each_alone(act_order: bool) -> None:
    """q, k and v (or gate and up) read one input: fasterquant_all sweeps their stacked rows once, and each
    result is the one fasterquant gives that linear alone (codes, scales, settled weights, loss)."""
    k = 128
    x = _correlated_inputs(512, k, seed=6)
    x[:, 3] = 0  # a dead input too
    ws = [torch.randn(n, k, generator=_gen(7 + i)) for i, n in enumerate((48, 16, 16))]
    together = GPTQ(k)
    together.add_batch(x)
    got = together.fasterquant_all(ws, 4, 32, False, act_order=act_order, block_size=48)
    assert together.H is None
    for w, r in zip(ws, got, strict=True):
        alone = GPTQ(k)
        alone.add_batch(x)
        want = alone.fasterquant(w, 4, 32, False, act_order=act_order, block_size=48)
        assert torch.allclose(r.wq, want.wq, atol=1e-6) and r.wq.shape == w.shape
        assert torch.equal(r.weight.qweight, want.weight.qweight) and torch.equal(
            r.weight.zeros, want.weight.zeros
        )
        assert torch.allclose(r.weight.scales.float(), want.weight.scales.float())
        assert r.loss == pytest.approx(want.loss, rel=1e-4)
        assert (r.weight.g_idx is None) == (not act_order)


def test_gptq_static_groups_dead_columns_and_per_channel() -> None:
    k = 128
    x = _correlated_inputs(512, k, seed=3)
    x[:, 7] = 0  # an input that is never active
    w = torch.randn(32, k, generator=_gen(4))
    for kw in ({"act_order": True, "static_groups": True}, {"group_size": -1, "act_order": True}):
        gptq = GPTQ(k)
        gptq.add_batch(x)
        r = gptq.fasterquant(w, 4, kw.pop("group_size", 32), True, **kw)
        assert r.weight.g_idx is None  # trivial g_idx dropped
        assert torch.equal(r.weight.dequantize().T, r.wq)
        assert bool((r.wq[:, 7] == 0).all())
        assert _out_err(w, r.wq, x) < _out_err(w, quantize_rtn(w, 4, r.weight.group_size).dequantize().T, x)


# ---- AWQ -------------------------------------------------------------------------------------------


def _outlier_inputs(n: int, k: int, seed: int = 5) -> torch.Tensor:
    x = torch.randn(n, k, generator=_gen(seed))
    x[:, torch.arange(0, k, 17)] *= 25  # a few salient channels, as in LLM activations
    return x


def test_awq_quantizer_matches_formats_2_2() -> None:
    w = torch.tensor([[0.2, 0.4, 0.9, 0.3], [-0.5, 0.1, 0.25, -0.05]])
    qw = quantize_awq(w, 4, 4).validate()
    for row in range(2):
        mx, mn = float(w[row].max()), float(w[row].min())
        s16 = float(torch.tensor(max(mx - mn, 1e-5) / 15).half())
        assert float(qw.scales[0, row]) == s16
        assert int(qw.zeros[0, row]) == min(max(-round(mn / s16), 0), 15)  # 0 when min > 0: no 0 in range
    assert torch.equal(qw.dequantize().T, fake_quantize(w, AWQQuantizer(4, False), 4))


def test_awq_scale_and_clip_beat_rtn_on_outlier_channels() -> None:
    k, g = 256, 64
    x = _outlier_inputs(512, k)
    w = torch.randn(96, k, generator=_gen(6)) / 16

    def linear(inp: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
        return inp @ ws[0].T

    s = search_scale(x, [w], linear, 4, g)
    assert s.shape == (k,) and bool((s > 0).all()) and float(s[0]) > float(s[1])  # salient channels scaled up
    prev, (ws,), _ = apply_scale(torch.ones(k), [w], s)
    xs = x * prev  # the folded previous op produces x / s
    assert torch.allclose(xs @ ws.T, x @ w.T, rtol=1e-5, atol=1e-4)
    clipped = apply_clip(ws, search_clip(ws, xs, 4, g))
    awq = quantize_awq(clipped, 4, g).validate().dequantize().T
    rtn = quantize_awq(w, 4, g).dequantize().T
    awq_err = float((xs @ awq.T - x @ w.T).pow(2).mean())
    rtn_err = float((x @ rtn.T - x @ w.T).pow(2).mean())
    assert awq_err < 0.7 * rtn_err


def _block_args(n_kv: int, arch: str = "Qwen2ForCausalLM") -> ModelArgs:
    return ModelArgs.from_hf_config(
        {
            "architectures": [arch],
            "vocab_size": 32,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": n_kv,
        }
    )


@pytest.mark.parametrize("n_kv", [4, 2])
def test_awq_scale_folding_leaves_the_block_unchanged(n_kv: int) -> None:
    torch.manual_seed(0)
    args = _block_args(n_kv)
    block = TransformerBlock(args).eval()  # qwen2: q/k/v biases, so v's bias is folded too
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x, pos = torch.randn(2, 10, 64), RotaryEmbedding(args)(torch.arange(10))
    with torch.no_grad():
        before = block(x, pos)
        rand = lambda n: torch.exp(torch.randn(n))  # noqa: E731
        s_o = rand(64) if n_kv == 4 else None
        fold_awq_scales(block, rand(64), s_o, rand(64), rand(96))
        after = block(x, pos)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


# ---- calibration driver ----------------------------------------------------------------------------


ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _tiny_llama(
    d: Path, *, seed: int = 0, n_kv: int = 2, tie: bool = False, outliers: bool = False, arch: str = "llama"
) -> Path:
    """A 2-layer llama (or qwen2: q/k/v biases; qwen3: q/k norms), hidden 64, whose embeddings are nearly
    low-rank, so activations are correlated."""
    g = _gen(seed)
    vocab, hidden, inter, heads = 256, 64, 128, 4
    hd = hidden // heads
    cfg = {
        "architectures": [ARCHS[arch]],
        "model_type": arch, "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": 2, "num_attention_heads": heads,
        "num_key_value_heads": n_kv, "rms_norm_eps": 1e-5, "max_position_embeddings": 256,
        "tie_word_embeddings": tie, "torch_dtype": "bfloat16",
    }  # fmt: skip

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(torch.bfloat16)

    emb = torch.randn(vocab, 8, generator=g) @ torch.randn(8, hidden, generator=g) / 3
    t = {
        "model.embed_tokens.weight": (emb + 0.3 * torch.randn(vocab, hidden, generator=g)).to(torch.bfloat16)
    }
    for i in range(2):
        p = f"model.layers.{i}."
        ln = 1 + 0.1 * torch.randn(hidden, generator=g)
        if outliers:
            ln[:3] *= 20
        t[p + "input_layernorm.weight"] = ln.to(torch.bfloat16)
        t[p + "post_attention_layernorm.weight"] = (1 + 0.1 * torch.randn(hidden, generator=g)).to(
            torch.bfloat16
        )
        for name, shape in (
            ("self_attn.q_proj", (heads * hd, hidden)), ("self_attn.k_proj", (n_kv * hd, hidden)),
            ("self_attn.v_proj", (n_kv * hd, hidden)), ("self_attn.o_proj", (hidden, heads * hd)),
            ("mlp.gate_proj", (inter, hidden)), ("mlp.up_proj", (inter, hidden)),
            ("mlp.down_proj", (hidden, inter)),
        ):  # fmt: skip
            t[p + name + ".weight"] = rnd(*shape)
            if arch == "qwen2" and name in LINEARS[:3]:
                t[p + name + ".bias"] = rnd(shape[0])
        if arch == "qwen3":
            t[p + "self_attn.q_norm.weight"] = (1 + 0.1 * torch.randn(hd, generator=g)).to(torch.bfloat16)
            t[p + "self_attn.k_norm.weight"] = (1 + 0.1 * torch.randn(hd, generator=g)).to(torch.bfloat16)
    t["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    if not tie:
        t["lm_head.weight"] = rnd(vocab, hidden)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(d / "model.safetensors"))
    return d


def _hidden(d: Path, items: list | None, tokens: torch.Tensor) -> torch.Tensor:
    """The model's final hidden states, from the checkpoint or from the quantizer's output."""
    args = ModelArgs.from_hf_config(json.loads((d / "config.json").read_text()))
    sd = load_file(str(d / "model.safetensors"))
    if items is not None:
        sd = {}
        for it in items:
            if isinstance(it, QuantizedLinear):
                sd[it.prefix + ".weight"] = it.weight.dequantize().T
                if it.bias is not None:
                    sd[it.prefix + ".bias"] = it.bias
            else:
                sd[it.name] = it.tensor
    model = Transformer(args)
    model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
    with torch.no_grad():
        return model.eval()(tokens)


@pytest.mark.slow  # a whole calibration run, twice
@pytest.mark.parametrize("tie", [False, True])
def test_driver_yields_every_linear_and_streams_one_layer(tmp_path: Path, monkeypatch, tie: bool) -> None:
    d = _tiny_llama(tmp_path / "m", tie=tie)
    loaded: list[tuple[str, weakref.ref]] = []
    get = SafetensorsReader.get

    def tracking_get(self, name: str) -> torch.Tensor:
        t = get(self, name)
        loaded.append((name, weakref.ref(t)))
        return t

    monkeypatch.setattr(SafetensorsReader, "get", tracking_get)
    tokens = torch.randint(0, 256, (4, 32), generator=_gen(7))
    names, per_layer = [], 9
    for item in quantize_model(d, "gptq", 4, 32, calib_tokens=tokens, progress=False):
        name = item.prefix if isinstance(item, QuantizedLinear) else item.name
        names.append(name)
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            # Streaming: nothing of a later layer has been read, and no earlier tensor is still alive.
            assert len(loaded) == 1 + (layer + 1) * per_layer
            del item
            gc.collect()
            alive = [n for n, ref in loaded if ref() is not None]
            assert all(n.startswith(f"model.layers.{layer}.") for n in alive), alive
    want = ["model.embed_tokens.weight"]
    for i in range(2):
        want += [f"model.layers.{i}.{n}" for n in LINEARS]
        want += [
            f"model.layers.{i}.input_layernorm.weight",
            f"model.layers.{i}.post_attention_layernorm.weight",
        ]
    want += ["model.norm.weight"] + ([] if tie else ["lm_head.weight"])
    assert names == want


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_driver_outputs_are_valid(tmp_path: Path, method: str) -> None:
    d = _tiny_llama(tmp_path / "m", n_kv=4)
    ckpt = load_file(str(d / "model.safetensors"))
    tokens = torch.randint(0, 256, (4, 32), generator=_gen(8))
    sym = method != "awq"
    items = list(quantize_model(d, method, 4, 32, sym, calib_tokens=tokens, progress=False, batch_size=3))
    for it in items:
        if isinstance(it, QuantizedLinear):
            w = ckpt[it.prefix + ".weight"]
            assert it.weight.validate(it.prefix).qweight.shape == (w.shape[1], w.shape[0])
            assert it.weight.qweight.device.type == "cpu" and it.bias is None and it.weight.symmetric == sym
            assert (it.loss is not None) == (method == "gptq")
        else:
            assert isinstance(it, DenseTensor) and it.tensor.dtype == torch.bfloat16
            if method != "awq" or "layernorm" not in it.name:  # AWQ divides the norms by its scales
                assert torch.equal(it.tensor, ckpt[it.name]), it.name


def test_gptq_and_awq_models_are_closer_to_fp_than_rtn(tmp_path: Path) -> None:
    g = _gen(9)
    calib, held_out = torch.randint(0, 256, (8, 64), generator=g), torch.randint(0, 256, (4, 64), generator=g)
    for outliers, method, sym in ((False, "gptq", True), (True, "awq", False)):
        d = _tiny_llama(tmp_path / f"m{outliers}", seed=1, outliers=outliers)
        ref = _hidden(d, None, held_out)

        def err(m: str, d: Path = d, ref: torch.Tensor = ref, sym: bool = sym) -> float:
            items = list(quantize_model(d, m, 3, 32, sym, calib_tokens=calib, progress=False))
            return float((_hidden(d, items, held_out) - ref).pow(2).mean() / ref.pow(2).mean())

        assert err(method) < 0.75 * err("rtn"), method


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_driver_on_qwen_keeps_biases_and_qk_norms(tmp_path: Path, arch: str) -> None:
    """8-bit AWQ barely rounds: the output stays close only if the driver folded its scales (x20 outlier
    channels) into the norms (the v_proj bias fold itself is checked on a block above)."""
    d = _tiny_llama(tmp_path / "m", n_kv=4, arch=arch, outliers=True)
    tokens = torch.randint(0, 256, (4, 32), generator=_gen(10))
    items = list(quantize_model(d, "awq", 8, 32, sym=False, calib_tokens=tokens, progress=False))
    linears = {it.prefix: it for it in items if isinstance(it, QuantizedLinear)}
    dense = {it.name for it in items if isinstance(it, DenseTensor)}
    assert len(linears) == 14
    for name, it in linears.items():
        assert (it.bias is not None) == (arch == "qwen2" and name.split(".", 3)[3] in LINEARS[:3]), name
    assert ("model.layers.1.self_attn.q_norm.weight" in dense) == (arch == "qwen3")
    ref = _hidden(d, None, tokens)
    assert float((_hidden(d, items, tokens) - ref).pow(2).mean() / ref.pow(2).mean()) < 1e-3


def test_driver_checks_options_before_any_work(tmp_path: Path) -> None:
    d = _tiny_llama(tmp_path / "m")
    with pytest.raises(ConfigError, match="K=64 is not a multiple of group_size 48"):
        quantize_model(d, "rtn", 4, 48)
    with pytest.raises(ConfigError, match="act-order"):
        quantize_model(
            d, "awq", 4, 32, sym=False, act_order=True, calib_tokens=torch.zeros(1, 8, dtype=torch.long)
        )
    with pytest.raises(ConfigError, match="method"):
        quantize_model(d, "squeezellm", 4, 32)
    with pytest.raises(ConfigError, match="vocabulary"):
        quantize_model(d, "gptq", 4, 32, calib_tokens=torch.full((1, 8), 999))


def test_calibration_text_and_windows() -> None:
    text = default_calibration_text()
    assert 8_000 < len(text) < 40_000
    eval_text = resources.files("quantserve").joinpath("data/eval.txt").read_text(encoding="utf-8")
    assert text[:200] not in eval_text  # calibration must not see the evaluation text
    t = split_tokens(list(range(1000)), n_samples=128, seq_len=300)
    assert (
        t.shape == (3, 300) and t[1, 0] == 300
    )  # consecutive, non-overlapping, fewer when the text is short
    assert split_tokens(list(range(100)), 4, 512).shape == (1, 100)
    with pytest.raises(ConfigError, match="only 3 tokens"):
        split_tokens([1, 2, 3])

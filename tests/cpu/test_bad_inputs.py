"""Bad inputs: each raises nsa.NSAInputError (a ValueError) whose message names the argument; invalid
NSAConfig fields raise ValueError naming the field."""

from __future__ import annotations

import pytest
import torch

import nsa
from nsa import NSAConfig, NSAInputError, nsa_attention

CFG = NSAConfig(block_cmp=8, stride_cmp=4, block_sel=8, n_sel=4, n_init=1, n_local=1, window=16)
B, T, HQ, HKV, DK, DV = 2, 20, 4, 2, 8, 6


def _inputs():
    g = torch.Generator().manual_seed(0)
    return dict(
        q=torch.randn(B, T, HQ, DK, generator=g),
        k=torch.randn(B, T, HKV, DK, generator=g),
        v=torch.randn(B, T, HKV, DV, generator=g),
        gates=torch.rand(B, T, HQ, 3, generator=g),
    )


def _packed():
    x = _inputs()
    return {n: t[:1] for n, t in x.items()}


def _cu(values, dtype=torch.int32, device="cpu"):
    return torch.tensor(values, dtype=dtype, device=device)


# (id, function building the call's arguments, the word(s) the message must contain)
CASES = [
    ("q-int", lambda x: {**x, "q": x["q"].to(torch.int32)}, "q"),
    ("k-float16-vs-q-float32", lambda x: {**x, "k": x["k"].half()}, "k"),
    ("v-float64-vs-q-float32", lambda x: {**x, "v": x["v"].double()}, "v"),
    ("gates-int", lambda x: {**x, "gates": x["gates"].to(torch.int64)}, "gates"),
    ("q-not-tensor", lambda x: {**x, "q": x["q"].tolist()}, "q"),
    ("q-3d", lambda x: {**x, "q": x["q"][0]}, "q"),
    ("k-5d", lambda x: {**x, "k": x["k"][None]}, "k"),
    ("v-3d", lambda x: {**x, "v": x["v"][:, :, 0]}, "v"),
    ("gates-3d", lambda x: {**x, "gates": x["gates"][..., 0]}, "gates"),
    ("k-batch", lambda x: {**x, "k": x["k"][:1]}, "k"),
    ("v-length", lambda x: {**x, "v": x["v"][:, :-1]}, "v"),
    ("k-length", lambda x: {**x, "k": x["k"][:, :-1]}, "k"),
    ("v-heads", lambda x: {**x, "v": x["v"][:, :, :1]}, "v"),
    ("hq-not-multiple-of-hkv", lambda x: {**x, "q": x["q"][:, :, :3], "gates": x["gates"][:, :, :3]}, "Hq"),
    ("hkv-more-than-hq", lambda x: {**x, "k": torch.cat([x["k"]] * 4, 2), "v": torch.cat([x["v"]] * 4, 2)}, "Hq"),
    ("dk-mismatch", lambda x: {**x, "k": x["k"][..., :-1]}, "k"),
    ("gates-heads", lambda x: {**x, "gates": x["gates"][:, :, :2]}, "gates"),
    ("gates-last-dim", lambda x: {**x, "gates": x["gates"][..., :2]}, "gates"),
    ("gates-length", lambda x: {**x, "gates": x["gates"][:, :-1]}, "gates"),
    ("k-on-meta", lambda x: {**x, "k": x["k"].to("meta")}, "k"),
    ("gates-on-meta", lambda x: {**x, "gates": x["gates"].to("meta")}, "gates"),
    ("cu-int64", lambda x: {**_packed(), "cu_seqlens": _cu([0, 5, 20], torch.int64)}, "cu_seqlens"),
    ("cu-float", lambda x: {**_packed(), "cu_seqlens": _cu([0, 5, 20], torch.float32)}, "cu_seqlens"),
    ("cu-list", lambda x: {**_packed(), "cu_seqlens": [0, 5, 20]}, "cu_seqlens"),
    ("cu-2d", lambda x: {**_packed(), "cu_seqlens": _cu([[0, 5, 20]])}, "cu_seqlens"),
    ("cu-one-entry", lambda x: {**_packed(), "cu_seqlens": _cu([20])}, "cu_seqlens"),
    ("cu-not-from-0", lambda x: {**_packed(), "cu_seqlens": _cu([1, 5, 20])}, "cu_seqlens"),
    ("cu-decreasing", lambda x: {**_packed(), "cu_seqlens": _cu([0, 12, 5, 20])}, "cu_seqlens"),
    ("cu-last-not-T", lambda x: {**_packed(), "cu_seqlens": _cu([0, 5, 19])}, "cu_seqlens"),
    ("cu-last-past-T", lambda x: {**_packed(), "cu_seqlens": _cu([0, 5, 21])}, "cu_seqlens"),
    ("cu-with-B2", lambda x: {**x, "cu_seqlens": _cu([0, 5, 20])}, "B"),
    ("cu-on-meta", lambda x: {**_packed(), "cu_seqlens": _cu([0, 5, 20], device="meta")}, "cu_seqlens"),
    ("idx-shape", lambda x: {**x, "block_indices": torch.zeros(B, T, HKV, CFG.n_sel + 1, dtype=torch.int32)},
     "block_indices"),
    ("idx-per-query-head", lambda x: {**x, "block_indices": torch.zeros(B, T, HQ, CFG.n_sel, dtype=torch.int32)},
     "block_indices"),
    ("idx-float", lambda x: {**x, "block_indices": torch.zeros(B, T, HKV, CFG.n_sel)}, "block_indices"),
    ("idx-list", lambda x: {**x, "block_indices": [[0]]}, "block_indices"),
    ("idx-on-meta", lambda x: {**x, "block_indices": torch.zeros(B, T, HKV, CFG.n_sel, dtype=torch.int32,
                                                                  device="meta")}, "block_indices"),
    ("backend-name", lambda x: {**x, "backend": "cuda"}, "backend"),
    ("config-dict", lambda x: {**x, "config": {"block_cmp": 8}}, "config"),
    ("config-none", lambda x: {**x, "config": None}, "config"),
    ("mlp-without-compress-fn", lambda x: {**x, "config": CFG.with_(compress="mlp")}, "compress_fn"),
    ("kv-cmp-shape", lambda x: {**x, "kv_cmp": (x["k"][:, :-1], x["v"][:, :-1])}, "kv_cmp"),
    ("kv-win-not-pair", lambda x: {**x, "kv_win": x["k"]}, "kv_win"),
    ("chunk-size-0", lambda x: {**x, "chunk_size": 0}, "chunk_size"),
]


@pytest.mark.parametrize("backend", ["torch", "reference", "auto"])
@pytest.mark.parametrize("make,word", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_naming_the_argument(make, word, backend):
    kwargs = {"config": CFG, "backend": backend, **make(_inputs())}
    args = [kwargs.pop(n) for n in ("q", "k", "v", "gates", "config")]
    with pytest.raises(NSAInputError) as info:
        nsa_attention(*args, **kwargs)
    assert isinstance(info.value, ValueError)
    assert word in str(info.value), str(info.value)


def test_reference_rejects_bad_inputs_too():
    x = _inputs()
    with pytest.raises(ValueError, match="k"):
        nsa.nsa_reference(x["q"], x["k"][..., :-1], x["v"], x["gates"], CFG)
    with pytest.raises(ValueError, match="cu_seqlens"):
        nsa.nsa_reference(x["q"][:1], x["k"][:1], x["v"][:1], x["gates"][:1], CFG, cu_seqlens=_cu([0, 3, 7]))


CONFIG_CASES = [
    (dict(block_cmp=32, stride_cmp=12), "stride_cmp"),  # does not divide block_cmp
    (dict(block_cmp=32, stride_cmp=16, block_sel=40), "stride_cmp"),  # does not divide block_sel
    (dict(n_sel=2, n_init=1, n_local=2), "n_sel"),
    (dict(block_cmp=0), "block_cmp"),
    (dict(stride_cmp=-4), "stride_cmp"),
    (dict(block_sel=0), "block_sel"),
    (dict(n_sel=0, n_init=0, n_local=0), "n_sel"),
    (dict(window=0), "window"),
    (dict(n_init=-1), "n_init"),
    (dict(n_local=-1), "n_local"),
    (dict(block_cmp=32.0), "block_cmp"),
    (dict(window=True), "window"),
    (dict(compress="max"), "compress"),
    (dict(compress=None), "compress"),
    (dict(scale=0.0), "scale"),
    (dict(scale=-1.0), "scale"),
    (dict(scale=float("nan")), "scale"),
    (dict(scale=float("inf")), "scale"),
    (dict(scale="0.1"), "scale"),
]


@pytest.mark.parametrize("fields,name", CONFIG_CASES, ids=[f"{n}-{list(f.values())[-1]!r}" for f, n in CONFIG_CASES])
def test_config_invalid_field_raises_naming_it(fields, name):
    with pytest.raises(ValueError, match=name):
        NSAConfig(**fields)


@pytest.mark.parametrize("fields", [dict(), dict(block_cmp=8, stride_cmp=8, block_sel=8, n_sel=1, n_init=0,
                                                 n_local=1, window=1), dict(scale=0.5, compress="mlp")])
def test_config_valid(fields):
    NSAConfig(**fields)

"""bench/train_showcase.py on CPU: the smoke run end to end, the corpora (fineweb-edu's loader with a stand-in
`datasets`, the fallback when the hub does not answer), packed batches and the packed loss."""

from __future__ import annotations

import importlib.util
import json
import socket
import sys
import types
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location(
    "train_showcase", Path(__file__).parents[2] / "bench" / "train_showcase.py"
)
TS = importlib.util.module_from_spec(_spec)
sys.modules["train_showcase"] = TS  # dataclasses look their module up by name
_spec.loader.exec_module(TS)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_smoke_trains_both_models_dense_and_packed(tmp_path, monkeypatch):
    monkeypatch.setenv("NSA_ACCUM", "2")
    report = TS.main(
        [
            "--tiny",
            "--steps",
            "2",
            "--seq-lens",
            "64",
            "--packed",
            "--dataset",
            "pydoc",
            "--warmup",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    runs = {(r["attention"], r["packed"]): r for r in report["runs"]}
    assert set(runs) == {("nsa", False), ("dense", False), ("nsa", True), ("dense", True)}
    assert {r["dense_backend"] for r in report["runs"] if r["attention"] == "dense"} == {"auto"}  # CPU's only one
    assert {r["label"] for r in report["runs"]} == {"nsa", "dense/auto"}  # what the runbook report prints
    for r in runs.values():
        assert r["tokens_per_step"] == 2 * 64 and r["tok_s"] > 0
        assert torch.isfinite(torch.tensor([r["loss_first"], r["loss_last"]])).all()
    assert runs[("nsa", False)]["nsa_paths"] and runs[("dense", False)]["nsa_paths"] is None
    assert set(report["nsa_over_dense_tok_s"]) == {"auto"}
    assert set(report["nsa_over_dense_tok_s"]["auto"]) == {"64", "64_packed"}
    saved = json.loads((tmp_path / "train_showcase.json").read_text())
    assert saved["corpus"]["corpus"] == "pydoc" and saved["args"]["accum"] == 2
    assert len((tmp_path / "train_showcase.csv").read_text().splitlines()) == 1 + 4 * 2


def _fake_datasets(monkeypatch, texts, calls):
    mod = types.ModuleType("datasets")

    def load_dataset(path, name=None, split=None, streaming=False):
        calls.append((path, name, split, streaming))
        return iter({"text": t} for t in texts)

    mod.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", mod)


def test_fineweb_is_streamed_through_datasets_up_to_the_byte_budget(monkeypatch):
    calls = []
    _fake_datasets(monkeypatch, ["first doc", "second doc", "third doc"], calls)
    monkeypatch.setattr(TS, "hub_unreachable", lambda timeout: None)
    docs, corpus = TS.load_corpus("fineweb_edu", max_bytes=15, hub_timeout=1)
    assert docs == [b"first doc", b"second doc"]  # stops once 15 bytes are in
    assert corpus == {"corpus": "fineweb_edu", "fallback": None}
    assert calls == [("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", True)]


def test_an_unreachable_hub_falls_back_to_pydoc_and_says_why(monkeypatch, capsys):
    calls = []
    _fake_datasets(monkeypatch, ["never read"], calls)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    docs, corpus = TS.load_corpus("fineweb_edu", max_bytes=100, hub_timeout=2)
    assert corpus["corpus"] == "pydoc" and "did not answer" in corpus["fallback"] and not calls
    assert len(docs) > 10 and "using the pydoc corpus" in capsys.readouterr().out


def test_offline_mode_and_a_failing_loader_fall_back_too(monkeypatch):
    _fake_datasets(monkeypatch, ["never read"], [])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, corpus = TS.load_corpus("fineweb_edu", max_bytes=100, hub_timeout=1)
    assert "HF_HUB_OFFLINE" in corpus["fallback"]
    monkeypatch.delenv("HF_HUB_OFFLINE")
    mod = types.ModuleType("datasets")
    mod.load_dataset = lambda *a, **k: (_ for _ in ()).throw(ConnectionError("503"))
    monkeypatch.setitem(sys.modules, "datasets", mod)
    monkeypatch.setattr(TS, "hub_unreachable", lambda timeout: None)
    _, corpus = TS.load_corpus("fineweb_edu", max_bytes=100, hub_timeout=1)
    assert corpus["corpus"] == "pydoc" and "ConnectionError: 503" in corpus["fallback"]


def test_unknown_dataset_and_bad_batch_variables_are_refused(monkeypatch):
    with pytest.raises(SystemExit, match="--dataset must be"):
        TS.load_corpus("wikipedia", max_bytes=1, hub_timeout=1)
    monkeypatch.setenv("NSA_BATCH_SIZE", "0")
    with pytest.raises(SystemExit, match="NSA_BATCH_SIZE must be a positive integer"):
        TS.parse_args([])
    monkeypatch.setenv("NSA_BATCH_SIZE", "two")
    with pytest.raises(SystemExit, match="NSA_BATCH_SIZE"):
        TS.parse_args([])


def test_packed_batches_cover_the_stream_with_whole_documents():
    data = TS.Batches([b"ab", b"cdefg", b"h", b"ijklmnopq"], seed=3)
    data.reset()
    for total in (1, 5, 17, 40):
        toks, cu = data.packed(total)
        c = cu.tolist()
        assert toks.shape == (1, total + 1) and c[0] == 0 and c[-1] == total
        assert all(b > a for a, b in zip(c, c[1:]))


@pytest.mark.parametrize("attention", ["dense", "nsa"])
def test_packed_loss_is_the_token_weighted_loss_of_each_document_alone(attention):
    shape = TS.ModelShape(1, 32, 2, 1, 16, 16)
    model = TS.build(attention, shape, torch.device("cpu"), seed=0).double()
    data = TS.Batches([bytes(range(65, 65 + n)) for n in (5, 90, 3, 70)], seed=1)
    data.reset()
    toks, cu = data.packed(160)  # documents longer than NSA's window and blocks
    got = TS.lm_loss(model, toks, cu)
    c = cu.tolist()
    total, count = 0.0, 0
    for a, b in zip(c, c[1:]):
        if b - a >= 2:  # a document's last input token predicts nothing
            doc = toks[:, a:b]
            n = b - a - 1
            total += TS.lm_loss(model, doc).item() * n
            count += n
    assert got.item() == pytest.approx(total / count, rel=1e-6)  # the loss itself is taken in fp32


def test_dense_backends_are_checked_and_gpu_ones_refused_on_cpu(tmp_path):
    assert TS.parse_args(["--dense-backends", "fa2, cudnn"]).dense_backends == ["fa2", "cudnn"]
    with pytest.raises(SystemExit):
        TS.parse_args(["--dense-backends", "flash"])
    with pytest.raises(SystemExit):
        TS.parse_args(["--dense-backends", ","])
    args = ["--tiny", "--steps", "1", "--seq-lens", "32", "--dataset", "pydoc", "--device", "cpu"]
    with pytest.raises(SystemExit, match="--dense-backends: fa2 and cudnn need a CUDA device"):
        TS.main([*args, "--dense-backends", "fa2", "--out", str(tmp_path)])


def test_ratios_pair_nsa_with_each_dense_backend_at_the_same_length():
    def run(att, backend, seq, packed, tok_s):
        return {"attention": att, "dense_backend": backend, "seq_len": seq, "packed": packed, "tok_s": tok_s}

    runs = [
        run("nsa", None, 8, False, 300.0),
        run("dense", "fa2", 8, False, 100.0),
        run("dense", "cudnn", 8, False, 150.0),
        run("nsa", None, 8, True, 200.0),
        run("dense", "fa2", 8, True, 400.0),
        run("dense", "fa2", 16, False, 1.0),
    ]
    assert TS.nsa_over_dense(runs) == {"fa2": {"8": 3.0, "8_packed": 0.5}, "cudnn": {"8": 2.0}}


def test_a_forced_backend_is_the_only_one_sdpa_may_use():
    from torch.nn.attention import SDPBackend

    ctx = TS.dense_backend("fa2")
    with ctx:
        assert torch._C._get_flash_sdp_enabled() and not torch._C._get_cudnn_sdp_enabled()
        assert not torch._C._get_mem_efficient_sdp_enabled() and not torch._C._get_math_sdp_enabled()
    assert isinstance(TS.dense_backend("auto"), type(TS.contextlib.nullcontext()))
    assert SDPBackend.CUDNN_ATTENTION.name == TS.DENSE_BACKENDS["cudnn"]


def test_compiled_runs_each_trace_afresh(tmp_path, monkeypatch):
    """Each compiled run resets Dynamo first, so a dense run never reuses a graph traced under another backend."""
    resets = []
    monkeypatch.setattr(TS.torch._dynamo, "reset", lambda: resets.append(1))
    monkeypatch.setattr(TS.torch, "compile", lambda model, mode: model)
    args = ["--tiny", "--steps", "1", "--seq-lens", "32", "--dataset", "pydoc", "--warmup", "0", "--compile"]
    import torch._inductor.config as inductor_config

    cache = inductor_config.fx_graph_cache
    report = TS.main([*args, "--out", str(tmp_path)])
    assert len(report["runs"]) == 2 and len(resets) == 2
    assert inductor_config.fx_graph_cache == cache  # the caches are restored: later compiles still use them


def test_a_dense_run_whose_forced_backend_did_not_serve_is_caught():
    fa2 = "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>"
    cudnn = "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3"
    assert TS.backend_served("fa2", [fa2]) is True
    assert TS.backend_served("fa2", [cudnn]) is False  # cuDNN's kernel names say flash too
    assert TS.backend_served("cudnn", [cudnn]) is True
    assert TS.backend_served("cudnn", [fa2]) is False
    assert TS.backend_served("cudnn", []) is False
    assert TS.backend_served("auto", [fa2]) is None and TS.backend_served(None, [fa2]) is None
    assert TS.backend_served("fa2", None) is None  # not profiled (CPU)


def test_attention_kernels_keeps_the_gpu_attention_kernels_only():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [
        types.SimpleNamespace(name="void pytorch_flash::flash_bwd_dq_dk_dv_loop_kernel<" + "x" * 200, device_type=cuda),
        types.SimpleNamespace(name="ampere_bf16_s16816gemm_bf16_128x64", device_type=cuda),
        types.SimpleNamespace(name="aten::scaled_dot_product_attention", device_type=cpu),
    ]
    got = TS.attention_kernels(types.SimpleNamespace(events=lambda: events))
    assert got == [events[0].name[:100]]


def test_graph_caches_are_off_for_the_runs_only():
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    before = (inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache)
    with TS.graph_caches_off():
        assert (inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache) == (False, False)
    assert (inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache) == before

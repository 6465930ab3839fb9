"""Training smoke (opt-in: NSA_TEST_TRAIN=1, as in the seeds' test plan): a few AdamW steps of the tiny
NSA language model of configs/base.yaml on a fixed token batch; the loss must fall and stay finite, and every
parameter must get a finite gradient. Runs on CPU, and on the GPU too where torch sees one.

    NSA_TEST_TRAIN=1 PYTHONPATH=. pytest -q -k "backward_parity or gradcheck or train"
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nsa import NSAConfig
from nsa.model import TinyNSALM

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "base.yaml"

pytestmark = pytest.mark.skipif(os.environ.get("NSA_TEST_TRAIN") != "1",
                                reason="training smokes run with NSA_TEST_TRAIN=1")


def _config() -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(CONFIG.read_text())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")])])
def test_train_smoke_loss_decreases(device):
    c = _config()
    m, n, t = c["model"], c["nsa"], c["train"]
    cfg = NSAConfig(block_cmp=n["block_cmp"], stride_cmp=n["stride_cmp"], block_sel=n["block_sel"],
                    n_sel=n["n_sel"], window=n["window"])
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = TinyNSALM(t["vocab"], m["dim"], t["n_layers"], m["n_heads"], m["n_kv_groups"], m["d_k"], m["d_v"],
                      cfg).to(device=device, dtype=dtype).train()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, t["vocab"], (t["batch_size"], t["seq_len"] + 1), generator=gen).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=float(t["lr"]), weight_decay=0.0)
    losses = []
    for _ in range(t["steps"]):
        opt.zero_grad(set_to_none=True)
        loss = model.loss(tokens)
        loss.backward()
        bad = [name for name, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
        assert not bad, f"missing or non-finite gradients: {bad}"
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        losses.append(model.loss(tokens).item())
    assert all(map(lambda x: x == x and abs(x) != float("inf"), losses)), losses
    assert losses[-1] < 0.8 * losses[0], f"the loss did not fall by 20 % in {t['steps']} AdamW steps: {losses}"

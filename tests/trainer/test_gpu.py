"""On a machine with a CUDA GPU: ``tpflex-train`` with the nccl backend, one rank bound
with ``torch.cuda.set_device`` and ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, bf16 autocast with
fp32 master weights; loss within 1% of the fp32 single-process reference (CPU).

Runnable with only a Python environment holding torch, transformers and safetensors:
``PYTHONPATH=trainer_hooks python -m pytest -c tests/pytest.ini -m gpu tests/trainer/test_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.trainer.hf_support import args, make_data, make_model_dir, reference_for, train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU for the nccl backend"),
]


@pytest.mark.parametrize("family, heads, kv, tied", [("llama", 8, 4, False), ("qwen3", 8, 2, True)])
def test_bf16_on_cuda_with_nccl_one_rank(tmp_path, family, heads, kv, tied):
    model = make_model_dir(tmp_path / family, family, heads=heads, kv=kv, tied=tied)
    data = make_data(tmp_path / "tokens.npy")
    argv = args(model, data, tmp_path / "out", tp=1, replicas=1, steps=8, dtype="bf16",
                weight_decay=0.1, clip_grad=1.0, warmup=2) + ["--backend", "nccl"]
    summary = train(argv)
    start = next(r for r in summary["reshards"] if r["at"] == "start")
    assert start["device"].startswith("cuda") and start["cuda_device_order"] == "PCI_BUS_ID"
    ref = reference_for(argv)  # fp32, one CPU process
    for got, want in zip(summary["losses"], ref["losses"], strict=True):
        assert abs(got - want) <= 0.01 * want, (got, want)
    assert summary["losses"][-1] < summary["losses"][0]

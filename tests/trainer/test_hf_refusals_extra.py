"""More HF refusals, raised while the adapter is built (before any collective): attention
heads that are not a multiple of the KV heads (``UnsupportedModelError``; ``tpflex-train``
exits 2 with ``--model: ...``), and a base TP degree below 1 (``LayoutError``
``degree_zero``, as for any model)."""

from __future__ import annotations

import pytest
from tpflex_trainer.ntp.errors import LayoutError, UnsupportedModelError

from tests.trainer.hf_support import make_data, make_model_dir


def _llama_config(heads: int, kv: int):
    from transformers import AutoConfig

    return AutoConfig.for_model("llama", vocab_size=128, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv,
                                head_dim=4, max_position_embeddings=64)


def test_heads_not_a_multiple_of_kv_heads_are_refused(tmp_path, capsys):
    from tpflex_trainer.ntp.hf_adapter import HfAdapter
    from tpflex_trainer.train.cli import main

    # 8 query heads over 3 KV heads: a KV-group unit would leave heads (q_proj rows,
    # o_proj columns) out of every unit
    for base_tp in (2, 4):  # KV-group units and query-head units alike
        with pytest.raises(UnsupportedModelError, match="num_attention_heads 8 .*num_key_value_heads 3"):
            HfAdapter(_llama_config(8, 3), base_tp)
    with pytest.raises(UnsupportedModelError, match="num_key_value_heads 0"):
        HfAdapter(_llama_config(8, 0), 2)  # not a ZeroDivisionError from HF's attention
    model = make_model_dir(tmp_path / "kv3", "llama", heads=8, kv=3, weights=False)
    data = make_data(tmp_path / "tokens.npy")
    with pytest.raises(SystemExit) as exc:
        main(["--model", str(model), "--data", str(data), "--out", str(tmp_path / "o"), "--tp", "2"])
    assert exc.value.code == 2
    assert "error: --model:" in capsys.readouterr().err
    HfAdapter(_llama_config(8, 2), 2)  # a multiple is still accepted


@pytest.mark.parametrize("base_tp", [0, -1, -2])
def test_base_tp_below_one_is_a_layout_error(tmp_path, base_tp):
    from tpflex_trainer.ntp.hf_adapter import HfAdapter
    from tpflex_trainer.ntp.hf_plan import choose_units
    from tpflex_trainer.ntp.runtime import NtpRuntime

    with pytest.raises(LayoutError, match=f"base_tp must be >= 1, got {base_tp}") as exc:
        HfAdapter(_llama_config(8, 4), base_tp)
    assert exc.value.code == "degree_zero"
    model = make_model_dir(tmp_path / "llama", "llama", heads=8, kv=4, weights=False)
    with pytest.raises(LayoutError) as exc:
        NtpRuntime(str(model), base_tp, (0, 0))
    assert exc.value.code == "degree_zero"
    with pytest.raises(LayoutError):
        choose_units(64, base_tp)

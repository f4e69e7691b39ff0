"""The demo's model and optimizer settings (shared by the workers and the reference run)."""

from __future__ import annotations

from tpflex_trainer.ntp.config import GPTConfig
from tpflex_trainer.ntp.optim import AdamSettings

DEMO_MODEL = GPTConfig(
    n_layers=2, hidden=64, n_heads=8, n_kv_groups=8, ffn_hidden=256, ffn_block=16,
    vocab=128, vocab_block=8, seq_len=32,
)
DEMO_ADAM = AdamSettings(lr=3e-3)
DEMO_SEED = 7
LOCAL_BATCH = 4

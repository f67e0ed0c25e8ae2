"""Shared fixtures: a tiny offline model built once per session."""

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny Qwen2 (head_dim 64) + byte-level BPE tokenizer trained on the toy task, as an HF folder."""
    from hpc_rl.config import TinyModelConfig
    from hpc_rl.data.toy import repeat_digit_corpus
    from hpc_rl.models.tiny import build_tiny_model

    return build_tiny_model(TinyModelConfig(), repeat_digit_corpus(), tmp_path_factory.mktemp("tiny") / "model")

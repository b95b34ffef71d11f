"""What the loss and train-state tests share: a tiny random Llama, and one torch thread."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores; tiny models gain nothing from more
    yield
    torch.set_num_threads(threads)


def _tiny_llama(vocab: int = 300, seed: int = 0, tied: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config)


@pytest.fixture
def tiny_llama() -> Callable[..., LlamaForCausalLM]:
    """``tiny_llama(vocab=300, seed=0, tied=False)``: a 2-layer, 64-wide random Llama (3 M parameters);
    ``tied``: its output layer is its input embeddings."""
    return _tiny_llama

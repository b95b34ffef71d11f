"""A tiny random Llama with a real tokenizer and chat template, built offline in about a second.

For tests across the project: ``tiny_model_dir(tmp_path)`` writes a Hugging Face directory that
``ModelEngine.from_pretrained``, ``AutoModelForCausalLM`` and PEFT load like any other. The tokenizer
is a byte-level BPE trained in-process on a few sentences (every string encodes, decoding
round-trips); the chat template is ChatML with system/user/assistant/tool roles and no native tool
support (so tools take the system-message path, as with SmolLM2). Nothing is downloaded.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CHATML_TEMPLATE", "build_tiny_tokenizer", "tiny_model_dir"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 plus 30? The answer is 42.",
    "You are a helpful assistant. Use the calculator tool when you need arithmetic.",
    '<tool_call>{"name": "calculator", "arguments": {"expression": "12+30"}}</tool_call>',
    "Hello! How can I help you today? I can answer questions and call tools.",
]


def build_tiny_tokenizer(vocab_size: int = 320):
    """A ``PreTrainedTokenizerFast``: byte-level BPE, ChatML special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_model_dir(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    max_position_embeddings: int = 512,
) -> Path:
    """Write a random 2-layer, 64-wide Llama plus tokenizer to ``path`` (reused if already there)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path
    tokenizer = build_tiny_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=ids[1],
        eos_token_id=ids[2],
        pad_token_id=ids[0],
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        # A wider init than the default 0.02 gives peaked, seed-dependent distributions, so
        # greedy decoding is not a sea of near-ties.
        for param in model.parameters():
            if param.dim() > 1:
                torch.nn.init.normal_(param, std=0.3)
    model.generation_config = GenerationConfig(bos_token_id=ids[1], eos_token_id=ids[2], pad_token_id=ids[0])
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path

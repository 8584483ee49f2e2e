"""Tiny random Llamas, tokenizers and prompt files, made on the spot (no downloads).

Used by ``make demo`` and the tests. Tokenizers are byte-level BPE trained with ``tokenizers`` on
a small built-in corpus (two different corpora give two genuinely different tokenizers) and
saved as HF fast tokenizers with a chat template.
"""

from __future__ import annotations

import json
import os

CORPUS_A = [
    "the quick brown fox jumps over the lazy dog", "a stitch in time saves nine",
    "count the numbers one two three four five six seven eight nine ten",
    "answer with yes or no", "what is two plus two? four", "the cat sat on the mat",
    "reinforcement learning from human feedback trains a policy with a reward model",
    "please write a short poem about the sea", "hello world, hello llama",
]
CORPUS_B = [
    "lorem ipsum dolor sit amet consectetur adipiscing elit", "sed do eiusmod tempor incididunt",
    "ut labore et dolore magna aliqua", "quis nostrud exercitation ullamco laboris",
    "the reward model reads the whole conversation and returns one number",
    "duis aute irure dolor in reprehenderit in voluptate velit esse",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PAD, BOS, EOS = 0, 1, 2


def make_tokenizer(path: str, corpus: list[str] = CORPUS_A, vocab_size: int = 301, chat_template: str | None = CHAT_TEMPLATE):
    """Train a byte-level BPE tokenizer (ids 0, 1, 2 = <pad>, <s>, </s>) and save it at ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(path)
    return fast


def random_hf_model(cfg, kind: str = "lm", seed: int = 0):
    """A random HF Llama of the ``LlamaConfig`` ``cfg``: ``kind`` lm is LlamaForCausalLM, score is
    LlamaForSequenceClassification with one label (a reward model)."""
    import torch
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(seed)
    if kind == "lm":
        return LlamaForCausalLM(cfg)
    cfg.num_labels = 1
    return LlamaForSequenceClassification(cfg)


def make_llama(path: str, *, vocab_size: int = 301, kind: str = "lm", seed: int = 0, hidden_size: int = 64,
               num_layers: int = 2, tokenizer_corpus: list[str] | None = CORPUS_A, dtype: str = "float32", **overrides):
    """Save a ``random_hf_model`` with a tokenizer at ``path``, its weights stored as ``dtype``; returns it."""
    import torch
    from transformers import LlamaConfig

    kw = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
              num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
              tie_word_embeddings=False)
    kw.update(overrides)
    model = random_hf_model(LlamaConfig(**kw), kind, seed)
    model.to(getattr(torch, dtype)).save_pretrained(path)
    if tokenizer_corpus is not None:
        make_tokenizer(path, tokenizer_corpus, vocab_size)
    return model


def make_prompts(path: str, n: int = 16, *, chat: bool = False, first: int = 0, id_prefix: str = "p") -> str:
    """A JSONL prompts file: ``prompt`` (text, or chat messages), ``id``, and ``answer``; rows
    ``first`` … ``first + n - 1`` of an endless toy set (another ``first``: other prompts)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    words = " ".join(CORPUS_A).split()
    with open(path, "w") as f:
        for i in range(first, first + n):
            text = " ".join(words[(i * 3) % len(words): (i * 3) % len(words) + 2 + i % 5])
            row = {"id": f"{id_prefix}{i:04d}", "prompt": [{"role": "user", "content": text}] if chat else text,
                   "answer": words[i % len(words)]}
            f.write(json.dumps(row) + "\n")
    return path

"""Tiny HF-format models built locally (no download): a Qwen2, Qwen3 or Qwen3-MoE causal LM from
a config and a byte-level BPE tokenizer trained on the synthetic task's text, saved with
`save_pretrained`.

The directory loads in transformers (AutoModelForCausalLM / AutoTokenizer), in the embedded
engine, in mbridge/megatron and, on GPU, in SGLang.

    streamrl model init runs/models/tiny --preset tiny
    streamrl model init runs/models/moe --preset tiny-moe

A preset names its architecture (`arch`, default qwen2). The MoE presets keep every layer sparse
(Qwen3-MoE's `decoder_sparse_step` 1, no shared expert) with top-2 of 4 experts: the smallest
layout where expert parallelism (ep=2: 2 experts a rank) and routing both mean something.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

ARCHS = ("qwen2", "qwen3", "qwen3_moe")
PRESETS: dict[str, dict[str, Any]] = {
    # ~0.1M parameters: fast enough for every test on 2 CPU cores.
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256),
    # ~3M parameters: the quick-start's default learner.
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=512),
    "tiny-qwen3": dict(arch="qwen3", hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256),
    # ~0.16M parameters: each expert's MLP is 1/3 of tiny's dense one, 2 of 4 run per token.
    "tiny-moe": dict(arch="qwen3_moe", hidden_size=64, moe_intermediate_size=64, num_experts=4,
                     num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, max_position_embeddings=256),
    # ~3.5M parameters: the MoE quick-start's learner.
    "small-moe": dict(arch="qwen3_moe", hidden_size=256, moe_intermediate_size=256, num_experts=4,
                      num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=32, max_position_embeddings=512),
}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2/Qwen3's pre-tokenizer split (transformers' Qwen2Tokenizer): single digits, letter and punctuation runs
QWEN_PRETOKENIZE = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                    r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# ChatML. With `tools`, a system block lists each function as name(parameters) (Qwen writes the
# whole JSON schema, which would not fit the tiny preset's 256 positions); an assistant's tool_calls
# are written as Qwen/Hermes `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, the
# format streamrl.core.chat parses (tests/test_chat.py checks they agree). Without tools and
# tool_calls it renders exactly what it did before they existed. (transformers renders templates with
# trim_blocks: a newline right after a block tag is dropped, hence {{ '\\n' }}.)
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n{% endif %}<tools>\n"
    "{% for t in tools %}{% set f = t['function'] if t['function'] is defined else t %}"
    "{{ f['name'] }}({{ (f['parameters']['properties'] if f['parameters'] is defined and "
    "f['parameters']['properties'] is defined else {}) | join(', ') }})\n{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if not (tools and loop.first and m['role'] == 'system') %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for c in m['tool_calls'] or [] %}{% set f = c['function'] if c['function'] is defined else c %}"
    "{% if m['content'] or not loop.first %}{{ '\\n' }}{% endif %}<tool_call>\n{\"name\": \"{{ f['name'] }}\", \"arguments\": "
    "{% if f['arguments'] is string %}{{ f['arguments'] }}{% else %}{{ f['arguments'] | tojson }}{% endif %}}"
    "\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus(seed: int) -> list[str]:
    """Text the tokenizer learns merges from: arithmetic and the words of chats and tools."""
    rng = random.Random(seed)
    arith = [f"{rng.randint(0, 999)}{rng.choice('+-*')}{rng.randint(0, 999)}={rng.randint(0, 9999)}"
             for _ in range(4000)]
    words = ("system user assistant tool You are a helpful assistant. Answer with the number only. "
             "The answer is calculator(expression) result: error Question: What is ").split(" ")
    return arith + [" ".join(rng.choice(words) for _ in range(12)) for _ in range(500)]


def build_tokenizer(vocab_size: int = 512, seed: int = 0) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(seed), trainer)
    # Saved with Qwen's own normalizer and pre-tokenizer (every digit its own pre-token), which
    # transformers substitutes anyway when it loads a qwen2 model's tokenizer (Qwen2Tokenizer) but
    # not for qwen3 / qwen3_moe: with the byte-level pre-tokenizer the merges were learned under,
    # those models saw "123" as one of ~160 number tokens, and arithmetic was far harder to learn
    # (the MoE quick-start gained +0.05 where the dense one gained +0.4). The merges themselves are
    # learned as before, so qwen2 models tokenize exactly as they did.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build_model(tokenizer: Any, preset: str = "tiny", seed: int = 0, vocab_size: int | None = None) -> Any:
    """A random model of `preset`'s shape; `vocab_size`: a larger embedding than the tokenizer's (the
    real-vocabulary memory benchmark)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    shape = dict(PRESETS[preset])
    arch = shape.pop("arch", "qwen2")
    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
                             "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM)}[arch]
    extra = dict(decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[]) if arch == "qwen3_moe" else {}
    cfg = config_cls(
        vocab_size=vocab_size or len(tokenizer),
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        torch_dtype="float32",
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **extra,
        **shape,
    )
    torch.manual_seed(seed)
    return model_cls(cfg).eval()


def init_model_dir(out: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Write a model + tokenizer directory; returns its path."""
    out = Path(out)
    tok = build_tokenizer(seed=seed)
    model = build_model(tok, preset, seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    return out

"""`streamrl plan RECIPE.yaml [key=value ...]`: before launching, what each learner rank holds for the model
(weights, fp32 gradients, fp32 main copies, Adam, a reference model; streamrl/core/learner_memory.py) at
the recipe's dtype and parallel layout, against the GPU's memory. The model's shape comes from
`model.path`/config.json, or `--model-config FILE`, or, for the models the GPU recipes name when they are
not on this machine, from their published configs below; and the activations of a micro-batch of the
recipe's longest rows (`--prompt-tokens` + rollout.max_new_tokens each, learner.micro_batch_size of them or
learner.max_tokens_per_micro_batch tokens) as the learner's megatron layers keep them
(core/learner_memory.activation_elements)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from streamrl.core import learner_memory as lm
from streamrl.recipe import Recipe, learner_layout

# The published config.json numbers of the models recipes/gpu_*.yaml train (facts: huggingface.co/Qwen).
KNOWN: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                         tie_word_embeddings=True),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
                       tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
                          mlp_only_layers=[], tie_word_embeddings=False),
}


def model_config(model_path: str, config_file: str | None = None) -> tuple[dict[str, Any], str]:
    """(the HF config as a dict, where it came from)."""
    path = Path(config_file) if config_file else Path(model_path) / "config.json"
    if path.is_file():
        return json.loads(path.read_text()), str(path)
    if config_file:
        raise ValueError(f"--model-config {config_file}: no such file")
    name = Path(model_path).name.lower()
    for key, cfg in KNOWN.items():
        if name.startswith(key):
            return dict(cfg), f"the published config of {key} (matched on model.path {model_path}; not on this machine)"
    raise ValueError(f"model.path {model_path} has no config.json here and is none of the known models "
                     f"({', '.join(KNOWN)}): pass --model-config PATH/TO/config.json")


def memory_plan(r: Recipe, config: dict[str, Any], source: str, gpu_gb: float, prompt_tokens: int = 512) -> dict[str, Any]:
    shape = lm.shape_of(config)
    tp, pp, dp = learner_layout(r)
    lc = r.learner
    ep = lc.parallel.ep
    b = lm.rank_bytes(shape, lc.dtype, tp, pp, dp, ep, lc.parallel.distributed_optimizer, reference=lc.kl_coef > 0)
    notes = []
    if lc.lora is not None:  # the base is frozen: no gradients or optimizer state of its own
        b |= {"gradients": 0.0, "main_fp32": 0.0, "adam": 0.0}
        b["total"] = b["weights"] + b["reference"]
        notes.append("LoRA: the base is frozen; the adapters' gradients and optimizer state are not counted")
    seq = prompt_tokens + r.rollout.max_new_tokens
    # a micro-batch of the longest rows: micro_batch_size of them, or the token cap (a row longer than it goes alone)
    tokens = max(lc.max_tokens_per_micro_batch, seq) if lc.max_tokens_per_micro_batch else lc.micro_batch_size * seq
    act = lm.activation_bytes(shape, lc.dtype, tokens, seq, tp, pp)
    b["model"] = b.pop("total")
    b |= {"activations": act["activations"], "logprob_chunks": act["logprob_chunks"]}
    b["total"] = b["model"] + b["activations"] + b["logprob_chunks"]
    total_gb = b["total"] / lm.GB
    notes.append(f"activations: a micro-batch of {tokens} tokens (rows of up to {seq}: --prompt-tokens {prompt_tokens} + "
                 f"rollout.max_new_tokens {r.rollout.max_new_tokens}), {act['per_token'] / 1e6:.2f} MB a token, "
                 f"{int(act['in_flight'])} micro-batch(es) in flight; no recompute; the CUDA allocator's slack "
                 "and the runtime (~1-3 GB) come on top")
    return {"recipe": r.run.name, "model": r.model.path, "config_source": source,
            "parameters_b": round(lm.total_parameters(shape) / 1e9, 3), "dtype": lc.dtype,
            "layout": {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "distributed_optimizer": lc.parallel.distributed_optimizer},
            "per_rank_gb": {k: round(v / lm.GB, 2) for k, v in b.items() if k != "parameters"},
            "per_rank_parameters_b": round(b["parameters"] / 1e9, 3), "gpu_gb": gpu_gb,
            "micro_batch": {"tokens": tokens, "seq": seq, "activation_mb_per_token": round(act["per_token"] / 1e6, 3)},
            "headroom_gb": round(gpu_gb - total_gb, 1), "fits": total_gb < gpu_gb, "notes": notes}


def print_memory(out: dict[str, Any]) -> None:
    con = Console()
    lay = out["layout"]
    con.print(f"[bold]{out['recipe']}[/bold]: {out['model']}, {out['parameters_b']}B parameters "
              f"({out['config_source']})")
    ep = f", ep {lay['ep']}" if lay["ep"] > 1 else ""
    con.print(f"learner: {out['dtype']}, tp {lay['tp']} x pp {lay['pp']} x dp {lay['dp']}{ep}, distributed optimizer "
              f"{'on' if lay['distributed_optimizer'] else 'off'}: {out['per_rank_parameters_b']}B parameters "
              "on the fullest rank")
    t = Table(title="per learner rank (GB)", caption="grads fp32; main: fp32 copies (bf16 learners); ref: the KL's "
              "reference model; act: one micro-batch's activations; logits: the log-probs' slabs")
    cols = {"weights": "weights", "gradients": "grads", "main_fp32": "main", "adam": "adam", "reference": "ref",
            "activations": "act", "logprob_chunks": "logits", "total": "total"}
    for label in cols.values():
        t.add_column(label, justify="right")
    t.add_row(*(f"{out['per_rank_gb'][k]:.1f}" for k in cols))
    con.print(t)
    verdict = "[green]fits[/green]" if out["fits"] else "[red]does not fit[/red]"
    con.print(f"{verdict} a {out['gpu_gb']:g} GB GPU: {out['headroom_gb']:.1f} GB left")
    for n in out["notes"]:
        con.print(f"note: {n}")

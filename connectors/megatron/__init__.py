"""The megatron-core learner backend.

`learner` (forward/backward/step on a batch of rows), `model` (a GPTModel from an HF checkpoint and
back), `parallel` (tp/pp/dp process groups), `optimizer`, `batch` (micro-batches and log-probs),
`checkpoint` and `sharded` (resharding checkpoints), `cpu_shim` (the patches that let megatron-core
run without CUDA, applied only then) and `model_kit` (the tiny HF model and tokenizer the CPU
quick-start builds locally)."""

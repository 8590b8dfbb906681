"""The model kit's tokenizer: one tokenization, whichever model family's directory it is loaded from.

transformers picks the tokenizer class from the model's config: a qwen2 directory loads as
Qwen2Tokenizer (which imposes Qwen's digit-by-digit pre-tokenizer), a qwen3 / qwen3_moe one as the
saved tokenizer.json. When the saved pre-tokenizer differed, the MoE quick-start's model read "146"
as one token and learned the task a tenth as fast as the dense one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from streamrl.connectors.megatron.model_kit import init_model_dir

TEXTS = ["146+9=", "155", "1234+5=1239", "You are a helpful assistant. Answer with the number only.",
         "Question: What is 12 * 7?\nThe answer is 84", " spaced   out\n\nlines "]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("kit")
    return {p: AutoTokenizer.from_pretrained(init_model_dir(Path(root) / p, p, seed=0))
            for p in ("tiny", "tiny-qwen3", "tiny-moe")}


def test_every_family_tokenizes_the_same_and_digits_one_by_one(tokenizers: dict[str, object]) -> None:
    ref = tokenizers["tiny"]
    assert type(ref).__name__ == "Qwen2Tokenizer"  # the class transformers imposes on qwen2 directories
    for preset, tok in tokenizers.items():
        for text in TEXTS:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert ids == ref(text, add_special_tokens=False)["input_ids"], (preset, text)
            assert tok.decode(ids) == text, (preset, text)
        digits = tok("1234", add_special_tokens=False)["input_ids"]
        assert [tok.decode([i]) for i in digits] == ["1", "2", "3", "4"], preset

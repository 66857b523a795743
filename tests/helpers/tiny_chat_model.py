"""A tiny random model with a byte-level BPE tokenizer and a chat template, for the serving and
decision tests: JSON punctuation, multi-byte characters (split over tokens), the decision
labels (yes, no, A-E, 1-5) as single tokens, and two PEFT adapters (the demo's writers)."""

from __future__ import annotations

from pathlib import Path

from detlora.entrypoints.demo import TinyModelShape, write_adapter, write_model

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
TEXT = (
    'yes no yes no maybe A B C D E 1 2 3 4 5 {"answer": "yes", "score": 3, "ok": true} '
    '[1, 2, 3] {"name": "café", "city": "東京", "note": "naïve façade"} '
    "Is this comment toxic? the state of the world is calm and the customer is angry . "
    "Question: Options: Answer with one label. State: "
)
LABELS = ("yes", "no", "A", "B", "C", "D", "E", "1", "2", "3", "4", "5")


def build_tokenizer(out_dir: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 20 + [" ".join(LABELS)] * 50, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    for label in LABELS:
        ids = fast(label, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, f"label {label!r} is not one token: {ids}"
    return tok.get_vocab_size()


def build_tiny_chat_model(root: Path) -> tuple[Path, list[Path]]:
    """Tokenizer + model in ``root/model`` and two adapters; returns their paths."""
    shape = TinyModelShape()
    model_dir = root / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(model_dir)
    write_model(model_dir, vocab, shape)
    adapters = [root / "adapter_a", root / "adapter_b"]
    for k, path in enumerate(adapters):
        write_adapter(path, shape, seed=100 + k)
    return model_dir, adapters

"""``Tokenizer.decode`` goes through the tokenizers backend only where that gives transformers'
own text: for a byte-level BPE tokenizer (the tiny chat model's) and the embedded SmolLM2 it
does, and every decode equals ``hf.decode``; for a WordPiece tokenizer whose decoding cleans
up spaces before punctuation (transformers' post-processing) it does not, and the text keeps
the clean-up. ``token_text`` is remembered per id and equals ``hf.decode([id])``."""

from __future__ import annotations

import random

import pytest
from tests.helpers.tiny_chat_model import build_tokenizer

from detlora.engine.tokenizer import Tokenizer, _backend_decode


def _random_ids(vocab: int, seed: int, count: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, 12))] for _ in range(count)]


def _check_equal(tok: Tokenizer, vocab: int) -> None:
    for ids in _random_ids(vocab, seed=vocab):
        assert tok.decode(ids) == tok.hf.decode(ids, skip_special_tokens=True), ids
        assert tok.token_text(ids[0]) == tok.hf.decode([ids[0]])


def test_byte_level_bpe_takes_the_backend_and_gives_the_same_text(tmp_path):
    vocab = build_tokenizer(tmp_path)
    tok = Tokenizer(tmp_path)
    assert _backend_decode(tok.hf) is not None
    _check_equal(tok, vocab)
    assert tok._fast_decode  # the backend was used


def test_smollm2_takes_the_backend_and_gives_the_same_text():
    import torch

    from detlora.models.embedded import smollm2_model_dir

    try:
        path = smollm2_model_dir(torch.float32)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tok = Tokenizer(path)
    assert _backend_decode(tok.hf) is not None
    _check_equal(tok, len(tok.hf))


def test_clean_up_of_spaces_keeps_transformers_path(tmp_path):
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[CLS]", "[SEP]", "hello", ",", "world", ".", "it", "'", "s", "n", "t",
             "!", "?", "re", "ve", "m", "a", "b"]
    raw = RawTokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    raw.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]",
                                   clean_up_tokenization_spaces=True)
    fast.save_pretrained(str(tmp_path))
    tok = Tokenizer(tmp_path)
    ids = fast("hello , world .", add_special_tokens=False)["input_ids"]
    assert tok.hf.decode(ids) == "hello, world."  # transformers cleans the spaces up
    assert _backend_decode(tok.hf) is None
    assert tok.decode(ids) == "hello, world."
    _check_equal(tok, len(words))


def test_text_with_a_lone_surrogate_is_a_clear_error(tmp_path):
    build_tokenizer(tmp_path)
    tok = Tokenizer(tmp_path)
    with pytest.raises(ValueError, match=r"the prompt is not valid text: .* at character 1"):
        tok.encode("a\ud800b")
    assert tok.encode("a b") == tok.hf("a b")["input_ids"]

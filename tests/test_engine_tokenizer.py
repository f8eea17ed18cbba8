"""The tokenizer rebuilt from GGUF metadata agrees with `tokenizers` loading the checkpoint's own
tokenizer.json, on text the tokenizer was not trained on; streaming emits only valid UTF-8."""
import pytest
from tokenizers import Tokenizer

from ds4tools.engine.tokenizer import (GGUFTokenizer, TokenizerError, byte_alphabet, spm_merges,
                                       NORMAL)
from ds4tools.gguf_io import open_gguf
from tests.fixtures import hf_models

HELD_OUT = [
    hf_models.corpus_text(60, seed=2024),  # the corpus generator with another seed
    "Unseen words: zyzzyva, quokka, fjord; numbers 3.14159 and 1234567890, tabs\tand\r\nCRLF.",
    "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n\n\n",
    "Ünïcödé: Ελληνικά, русский, العربية, 한국어, 😀🚀 and a lone combining mark e\u0301.",
    "   leading spaces, trailing spaces   ",
    "I'M SHOUTING, you're whispering; they'll've gone. It's 'quoted' \"text\".",
    "x",
]


def _convert(folder, out):
    from ds4tools.quantize import QuantizeOptions, quantize_model
    quantize_model(folder, out, QuantizeOptions("F32", progress=False), report=lambda m: None)
    return open_gguf(out).metadata


@pytest.fixture(scope="module")
def tokenizers(hf_llama, hf_qwen3, hf_llama_spm, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    gpt2 = folder / "gpt2-style"
    gpt2.mkdir()
    tok = hf_models.train_byte_level_bpe("gpt2", vocab_size=350, specials=["<|endoftext|>"])
    hf_models.write_tokenizer(gpt2, tok, bos="<|endoftext|>", eos="<|endoftext|>")
    cfg = hf_models.qwen3_config(tok.get_vocab_size(), num_hidden_layers=1, head_dim=64,
                                 intermediate_size=256)
    (gpt2 / "config.json").write_text(__import__("json").dumps(cfg))
    hf_models.write_weights(gpt2, hf_models.random_weights(cfg, 1, qk_norm=True))
    out = {}
    for name, src in (("llama3", hf_llama), ("qwen2", hf_qwen3), ("spm", hf_llama_spm), ("gpt2", gpt2)):
        meta = _convert(src, folder / f"{name}.gguf")
        out[name] = (GGUFTokenizer(meta), Tokenizer.from_file(str(src / "tokenizer.json")), meta)
    return out


@pytest.mark.parametrize("name", ["llama3", "qwen2", "spm", "gpt2"])
def test_encode_matches_checkpoint_tokenizer(tokenizers, name):
    ours, ref, meta = tokenizers[name]
    for text in HELD_OUT:
        assert ours.encode(text, add_special=False) == ref.encode(text, add_special_tokens=False).ids, text[:40]


def test_pre_tokenizer_names(tokenizers):
    assert tokenizers["llama3"][0].pre == "llama-bpe"
    assert tokenizers["qwen2"][0].pre == "qwen2"
    assert tokenizers["gpt2"][0].pre == "gpt-2"
    assert tokenizers["spm"][0].model == "llama"


def test_bos_as_the_checkpoint_adds_it(tokenizers):
    # llama3 and spm checkpoints add BOS through their post-processor; qwen2 adds none
    for name in ("llama3", "spm", "qwen2"):
        ours, ref, meta = tokenizers[name]
        text = HELD_OUT[1]
        assert ours.encode(text) == ref.encode(text).ids, name
    assert tokenizers["llama3"][0].add_bos and not tokenizers["qwen2"][0].add_bos


def test_special_tokens_are_atomic(tokenizers):
    ours, ref, _ = tokenizers["qwen2"]
    text = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    ids = ours.encode(text)
    assert ids == ref.encode(text).ids
    assert ids[0] == ref.token_to_id("<|im_start|>")
    assert ours.eos_id == ref.token_to_id("<|im_end|>") and ours.eos_id in ours.eog_ids
    # a control token prints as nothing (llama.cpp's default), text around it survives
    assert ours.decode(ids) == "user\nhello\nassistant\n"


@pytest.mark.parametrize("name", ["llama3", "qwen2", "gpt2"])
def test_byte_level_round_trip(tokenizers, name):
    ours = tokenizers[name][0]
    for text in HELD_OUT:
        assert ours.decode(ours.encode(text, add_special=False)) == text


def test_spm_round_trip_with_byte_fallback(tokenizers):
    ours = tokenizers["spm"][0]
    text = "Ελληνικά 😀 ok"  # characters the small vocabulary only has as <0xXX> bytes
    ids = ours.encode(text, add_special=False)
    assert any(ours.tokens[i].startswith("<0x") for i in ids)
    assert ours.decode(ids) == " " + text  # the prepended space marker, as SentencePiece does


@pytest.mark.parametrize("name", ["spm", "qwen2"])
def test_stream_emits_only_complete_utf8(tokenizers, name):
    ours = tokenizers[name][0]
    text = "😀 ε → 日本語 é"
    ids = ours.encode(text, add_special=False)
    stream = ours.stream()
    pieces = [stream.feed(i) for i in ids]
    assert "\ufffd" not in "".join(pieces)
    for p in pieces:
        p.encode("utf-8")  # each piece is valid on its own
    assert "".join(pieces) + stream.flush() == ours.decode(ids)
    # a multi-byte character split over tokens: the first pieces hold nothing back out
    if name == "spm":
        assert "" in pieces


def test_stream_drops_nothing_but_an_unfinished_tail(tokenizers):
    ours = tokenizers["spm"][0]
    b0 = ours.tokens.index("<0xF0>")
    stream = ours.stream()
    assert stream.feed(b0) == ""
    assert stream.flush() == "\ufffd"


def test_spm_merges_from_scores():
    tokens = ["<unk>", "a", "b", "c", "ab", "bc", "abc"]
    scores = [0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -0.5]
    types = [2] + [NORMAL] * 6
    # abc (best score) splits as a+bc and ab+c; then ab, then bc
    assert spm_merges(tokens, scores, types) == [("a", "bc"), ("ab", "c"), ("a", "b"), ("b", "c")]


def test_byte_alphabet_is_a_bijection():
    table = byte_alphabet()
    assert len(set(table.values())) == 256
    assert table[ord("A")] == "A" and table[ord(" ")] == "\u0120"


@pytest.mark.parametrize("change, message", [
    ({"tokenizer.ggml.pre": "bloom"}, "unsupported tokenizer.ggml.pre 'bloom'"),
    ({"tokenizer.ggml.model": "bert"}, "unsupported tokenizer.ggml.model 'bert'"),
    ({"tokenizer.ggml.merges": None}, "missing metadata key tokenizer.ggml.merges"),
    ({"tokenizer.ggml.token_type": [1]}, "tokenizer.ggml.token_type has 1 entries"),
    ({"tokenizer.ggml.eos_token_id": 10 ** 6}, "tokenizer.ggml.eos_token_id = 1000000 is outside"),
])
def test_bad_tokenizer_metadata(tokenizers, change, message):
    meta = dict(tokenizers["qwen2"][2])
    for k, v in change.items():
        if v is None:
            meta.pop(k)
        else:
            meta[k] = v
    with pytest.raises(TokenizerError, match=message.replace("(", r"\(")):
        GGUFTokenizer(meta)

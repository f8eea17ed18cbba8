"""The tokenizer a GGUF carries (tokenizer.ggml.*), rebuilt as a ``tokenizers.Tokenizer``.

Two models, as llama.cpp reads them:

* ``gpt2``: byte-level BPE. Tokens and merges are stored in the GPT-2 byte alphabet; the text is
  first split by the regex that ``tokenizer.ggml.pre`` names, then mapped to that alphabet.
* ``llama``: SentencePiece-style BPE. Tokens carry scores; ``▁`` stands for a space, one space is
  prepended to the text (``add_space_prefix``), and bytes without a token of their own become
  ``<0xXX>`` byte tokens. The merges are derived from the scores as Hugging Face's sentencepiece
  converter derives them: every split of a token into two tokens, best-scored token first.

Control and user-defined tokens are matched atomically in the text. BOS/EOS are added as the
file says (``tokenizer.ggml.add_bos_token``...), with llama.cpp's defaults otherwise.
Decoding goes through per-token bytes, and ``StreamDecoder`` only ever emits complete UTF-8.
"""
from __future__ import annotations

import codecs
from functools import lru_cache

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

# llama.cpp's token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPACE_MARK = "\u2581"  # SentencePiece's "▁"

_GPT2 = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's "default" pre-tokenizer: several regexes, each splitting the previous pieces
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2.rsplit("|", 1)[0], r"\p{N}+", r"[0-9][0-9][0-9]")

#: tokenizer.ggml.pre -> (regexes applied in sequence, ignore_merges, add_bos default)
PRE_TOKENIZERS = {
    "gpt-2": ((_GPT2,), False, False),
    "llama-bpe": ((_LLAMA3,), True, True),
    "llama3": ((_LLAMA3,), True, True),
    "llama-v3": ((_LLAMA3,), True, True),
    "qwen2": ((_QWEN2,), False, False),
    "default": (_DEFAULT, False, False),
}


class TokenizerError(ValueError):
    """A tokenizer metadata problem; the caller adds the file name."""


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves,
    the other 68 bytes take the characters from U+0100 on, in byte order."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(0x100 + extra)
            extra += 1
    return out


def _list(meta: dict, key: str, required: bool = True):
    v = meta.get(key)
    if v is None:
        if required:
            raise TokenizerError(f"missing metadata key {key}")
        return None
    if not isinstance(v, list):
        raise TokenizerError(f"metadata key {key} must be an array")
    return v


def _token_id(meta: dict, key: str, n_vocab: int, default=None):
    v = meta.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise TokenizerError(f"metadata key {key} must be an integer")
    if not 0 <= v < n_vocab:
        if key in meta:
            raise TokenizerError(f"metadata key {key} = {v} is outside the vocabulary (0..{n_vocab - 1})")
        return None
    return v


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges implied by SentencePiece scores: for every normal token, each split into two
    normal tokens; ordered by the merged token's score (best first), then by token ids."""
    ids = {t: i for i, t in enumerate(tokens) if types[i] == NORMAL}
    ranked = []
    for merged, i in ids.items():
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            li, ri = ids.get(left), ids.get(right)
            if li is not None and ri is not None:
                ranked.append((-float(scores[i]), i, li, ri, left, right))
    ranked.sort(key=lambda r: r[:4])
    return [(r[4], r[5]) for r in ranked]


class GGUFTokenizer:
    """encode / decode with the tokenizer stored in a GGUF's metadata."""

    def __init__(self, meta: dict):
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise TokenizerError("missing metadata key tokenizer.ggml.model (the file has no tokenizer)")
        if model not in ("gpt2", "llama"):
            raise TokenizerError(f"unsupported tokenizer.ggml.model {model!r} (known: gpt2, llama)")
        tokens = _list(meta, "tokenizer.ggml.tokens")
        if not tokens or not all(isinstance(t, str) for t in tokens):
            raise TokenizerError("tokenizer.ggml.tokens must be a non-empty array of strings")
        n = len(tokens)
        types = _list(meta, "tokenizer.ggml.token_type", required=False)
        if types is None:
            types = [NORMAL] * n
        if len(types) != n:
            raise TokenizerError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        self.model = model
        self.tokens = tokens
        self.types = [int(t) for t in types]
        self.n_vocab = n

        if model == "gpt2":
            pre = meta.get("tokenizer.ggml.pre", "default")
            if pre not in PRE_TOKENIZERS:
                raise TokenizerError(f"unsupported tokenizer.ggml.pre {pre!r} "
                                     f"(known: {', '.join(PRE_TOKENIZERS)})")
            regexes, ignore_merges, bos_default = PRE_TOKENIZERS[pre]
            self.pre = pre
            merges = _list(meta, "tokenizer.ggml.merges")
            pairs = []
            for m in merges:
                parts = m.split(" ", 1) if isinstance(m, str) else ()
                if len(parts) != 2:
                    raise TokenizerError(f"bad entry {m!r} in tokenizer.ggml.merges")
                pairs.append((parts[0], parts[1]))
            bpe = models.BPE({t: i for i, t in enumerate(tokens)}, pairs, ignore_merges=ignore_merges)
            tok = Tokenizer(bpe)
            splits = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in regexes]
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            tok.decoder = decoders.ByteLevel()
            add_space_prefix = False
        else:
            self.pre = None
            scores = _list(meta, "tokenizer.ggml.scores")
            if len(scores) != n:
                raise TokenizerError(f"tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")
            bos_default = True
            add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
            unk = _token_id(meta, "tokenizer.ggml.unknown_token_id", n, default=None)
            if unk is None:
                unk = next((i for i, t in enumerate(self.types) if t == UNKNOWN), None)
            bpe = models.BPE({t: i for i, t in enumerate(tokens)}, spm_merges(tokens, scores, self.types),
                             unk_token=tokens[unk] if unk is not None else None,
                             fuse_unk=True, byte_fallback=True)
            tok = Tokenizer(bpe)
            # llama.cpp puts a space before every piece of text that starts the prompt or
            # follows a special token, then writes spaces as "▁"; a normalizer does exactly that
            # per segment (Metaspace would not add one before text that starts with a space).
            spaces = [normalizers.Replace(" ", SPACE_MARK)]
            if add_space_prefix:
                spaces.insert(0, normalizers.Prepend(SPACE_MARK))
            tok.normalizer = normalizers.Sequence(spaces)
            tok.decoder = decoders.Sequence([decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(),
                                             decoders.Fuse()])
        self.add_space_prefix = add_space_prefix
        special = [AddedToken(t, special=True, normalized=False)
                   for t, ty in zip(tokens, self.types) if ty in (CONTROL, USER_DEFINED) and t]
        if special:
            tok.add_special_tokens(special)
        self.tokenizer = tok

        # llama.cpp's defaults: SPM 1 / 2, BPE none (the ids must then be in the file)
        spm = model == "llama"
        self.bos_id = _token_id(meta, "tokenizer.ggml.bos_token_id", n, default=1 if spm else None)
        self.eos_id = _token_id(meta, "tokenizer.ggml.eos_token_id", n, default=2 if spm else None)
        self.eot_id = _token_id(meta, "tokenizer.ggml.eot_token_id", n)
        self.eom_id = _token_id(meta, "tokenizer.ggml.eom_token_id", n)
        self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", bos_default)) and self.bos_id is not None
        self.add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and self.eos_id is not None
        #: tokens that end generation (llama.cpp's end-of-generation set)
        self.eog_ids = frozenset(i for i in (self.eos_id, self.eot_id, self.eom_id) if i is not None)
        self._bytes = None

    # --- encoding ----------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special``, BOS/EOS as the model wants them."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special:
            if self.add_bos:
                ids = [self.bos_id] + ids
            if self.add_eos:
                ids = ids + [self.eos_id]
        return ids

    # --- decoding ----------------------------------------------------------------------------

    def token_bytes(self, i: int) -> bytes:
        """What token i prints as (control tokens print nothing, as llama.cpp's default);
        computed on first use (a 150k vocabulary need not be walked to print a few tokens)."""
        if self._bytes is None:
            self._bytes = [None] * self.n_vocab
        b = self._bytes[i]
        if b is None:
            b = self._bytes[i] = self._piece(i)
        return b

    def _piece(self, i: int) -> bytes:
        text, ty = self.tokens[i], self.types[i]
        if ty in (CONTROL, UNUSED):
            return b""
        if self.model == "gpt2":
            if ty == USER_DEFINED:
                return text.encode("utf-8")
            back = _byte_decoder()
            try:
                return bytes(back[c] for c in text)
            except KeyError:  # not in the byte alphabet: take the text as it is
                return text.encode("utf-8")
        if ty == BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            return bytes([int(text[3:5], 16)])
        return text.replace(SPACE_MARK, " ").encode("utf-8")

    def decode_bytes(self, ids) -> bytes:
        return b"".join(self.token_bytes(int(i)) for i in ids)

    def decode(self, ids) -> str:
        """Text of ``ids`` (invalid UTF-8 becomes U+FFFD)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def stream(self) -> "StreamDecoder":
        return StreamDecoder(self)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    return {c: b for b, c in byte_alphabet().items()}


class StreamDecoder:
    """Turns tokens into text as they come, holding back an incomplete UTF-8 sequence until
    the bytes that finish it arrive (a multi-byte character may span several tokens)."""

    def __init__(self, tok: GGUFTokenizer):
        self._bytes = tok.token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._utf8.decode(self._bytes(int(token_id)))

    @property
    def pending(self) -> int:
        """Bytes held back: the start of a character whose remaining bytes have not come."""
        return len(self._utf8.getstate()[0])

    def flush(self) -> str:
        """Whatever is left at the end (an unfinished sequence becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)

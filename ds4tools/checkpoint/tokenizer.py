"""tokenizer.json (+ tokenizer_config.json, config.json) -> llama.cpp's ``tokenizer.ggml.*`` keys.

Two families are understood:
- byte-level BPE (GPT-2, Llama 3, Qwen): ``tokenizer.ggml.model = "gpt2"``, the merges, and
  ``tokenizer.ggml.pre`` named after the pre-tokenizer regex, with a name llama.cpp knows;
- SentencePiece-style BPE (Llama 2: byte fallback, "▁" for spaces): ``"llama"``, with token
  scores that make llama.cpp's score-driven merging follow the BPE merge order.
"""
from __future__ import annotations

import json
import os
import re

from gguf import GGUFValueType as V
from gguf import Keys, TokenType

from ..errors import InvalidContentError, about
from ..gguf_io import MetaKey

__all__ = ["tokenizer_metadata", "PRE_TOKENIZER_NAMES", "pre_tokenizer_name"]

# Pre-tokenizer regexes (as tokenizer.json spells them) and the name llama.cpp gives each.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
PRE_TOKENIZER_NAMES = {
    _GPT2_REGEX: "gpt-2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen35",
}
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
T = Keys.Tokenizer
# special token kind -> its id key (gguf's spelling, "seperator" included)
_SPECIAL_KEYS = {"bos": T.BOS_ID, "eos": T.EOS_ID, "unk": T.UNK_ID, "sep": T.SEP_ID,
                 "pad": T.PAD_ID, "mask": T.MASK_ID}


def _flatten(node, kind: str):
    """Yield the leaves of a tokenizer.json component, looking inside Sequence nodes."""
    if not node:
        return
    if node.get("type") == "Sequence":
        for child in node.get(kind, []):
            yield from _flatten(child, kind)
    else:
        yield node


def pre_tokenizer_name(tokenizer_json: dict, where: str) -> str:
    """llama.cpp's name (``tokenizer.ggml.pre``) for a byte-level BPE's pre-tokenizer."""
    parts = list(_flatten(tokenizer_json.get("pre_tokenizer"), "pretokenizers"))
    regexes = []
    for p in parts:
        if p.get("type") == "Split":
            pattern = p.get("pattern", {})
            if "Regex" not in pattern or p.get("invert"):
                break
            regexes.append(pattern["Regex"])
        elif p.get("type") == "ByteLevel":
            if p.get("use_regex", True):
                regexes.append(_GPT2_REGEX)
        else:
            regexes = None
            break
    if regexes is not None and len(regexes) == 1 and regexes[0] in PRE_TOKENIZER_NAMES:
        return PRE_TOKENIZER_NAMES[regexes[0]]
    shown = json.dumps(tokenizer_json.get("pre_tokenizer"))[:200]
    raise InvalidContentError(about(
        where, f"pre-tokenizer not recognised ({shown}); llama.cpp would split text "
               f"differently (known: GPT-2, Llama 3, Qwen2, Qwen3.5 regexes)"))


def _token_content(entry) -> str | None:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return entry["content"]
    return None


class _Vocab:
    """Token id <-> text, with the added tokens' flags, for one tokenizer.json."""

    def __init__(self, tj: dict, where: str):
        model = tj.get("model") or {}
        vocab = model.get("vocab")
        if not isinstance(vocab, dict):
            raise InvalidContentError(about(where, "tokenizer.json has no model.vocab"))
        self.by_id: dict[int, str] = {}
        self.ids: dict[str, int] = {}
        for text, i in vocab.items():
            self.by_id[int(i)] = text
            self.ids[text] = int(i)
        self.added: dict[int, dict] = {}
        for a in tj.get("added_tokens") or []:
            i, text = int(a["id"]), a["content"]
            self.by_id[i] = text
            self.ids.setdefault(text, i)
            self.added[i] = a

    def id_of(self, text: str | None) -> int | None:
        return None if text is None else self.ids.get(text)

    @property
    def size(self) -> int:
        return max(self.by_id) + 1 if self.by_id else 0


def _merges(model: dict, where: str) -> list[str]:
    merges = model.get("merges") or []
    out = []
    for m in merges:
        if isinstance(m, str):
            out.append(m)
        elif isinstance(m, (list, tuple)) and len(m) == 2:
            # a space inside a part would split wrongly on "a b": store it as U+0120, as gguf does
            out.append(" ".join(p.replace(" ", "\u0120") for p in m))
        else:
            raise InvalidContentError(about(where, f"tokenizer.json merge {m!r} is malformed"))
    return out


def _template_specials(tj: dict) -> tuple[str | None, str | None]:
    """The special tokens a TemplateProcessing post-processor puts first and last."""
    for proc in _flatten(tj.get("post_processor"), "processors"):
        if proc.get("type") == "TemplateProcessing":
            single = proc.get("single") or []
            first = single[0].get("SpecialToken", {}).get("id") if single else None
            last = single[-1].get("SpecialToken", {}).get("id") if len(single) > 1 else None
            return first, last
    return None, None


def _chat_templates(folder: str, tc: dict) -> list[MetaKey]:
    template = tc.get("chat_template")
    jinja = os.path.join(folder, "chat_template.jinja")
    if template is None and os.path.exists(jinja):
        with open(jinja, encoding="utf-8") as fh:
            template = fh.read()
    if isinstance(template, str):
        return [MetaKey(T.CHAT_TEMPLATE, template, V.STRING)]
    keys, names = [], []
    if isinstance(template, list):
        for t in template:
            if not isinstance(t, dict) or not isinstance(t.get("template"), str):
                continue
            name = t.get("name", "default")
            if name == "default":
                keys.append(MetaKey(T.CHAT_TEMPLATE, t["template"], V.STRING))
            else:
                names.append(name)
                keys.append(MetaKey(T.CHAT_TEMPLATE_N.format(name=name), t["template"], V.STRING))
        if names:
            keys.append(MetaKey(T.CHAT_TEMPLATES, names, V.ARRAY, V.STRING))
    return keys


def tokenizer_metadata(folder: str, config: dict, n_vocab: int, report=lambda msg: None) -> list[MetaKey]:
    """All ``tokenizer.*`` keys for the HF model in ``folder`` whose embedding has ``n_vocab`` rows."""
    where = os.path.join(folder, "tokenizer.json")
    try:
        with open(where, encoding="utf-8") as fh:
            tj = json.load(fh)
    except FileNotFoundError:
        raise InvalidContentError(about(folder, "tokenizer.json is missing")) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidContentError(about(where, f"not valid JSON: {e}")) from None
    tc_path = os.path.join(folder, "tokenizer_config.json")
    tc = {}
    if os.path.exists(tc_path):
        with open(tc_path, encoding="utf-8") as fh:
            try:
                tc = json.load(fh)
            except json.JSONDecodeError as e:
                raise InvalidContentError(about(tc_path, f"not valid JSON: {e}")) from None
    model = tj.get("model") or {}
    if model.get("type") != "BPE":
        raise InvalidContentError(about(
            where, f"tokenizer model {model.get('type')!r} is not supported (byte-level BPE and "
                   f"SentencePiece-style BPE are)"))
    vocab = _Vocab(tj, where)
    if vocab.size > n_vocab:
        report(f"warning: {where}: tokenizer has {vocab.size} tokens but the embedding only "
               f"{n_vocab} rows; ids >= {n_vocab} are dropped")
    spm_style = bool(model.get("byte_fallback"))
    keys: list[MetaKey] = []

    # special tokens: tokenizer_config.json names them, config.json has ids as a fallback
    special_ids: dict[str, int] = {}
    for kind in _SPECIAL_KEYS:
        i = vocab.id_of(_token_content(tc.get(f"{kind}_token")))
        if i is None and isinstance(config.get(f"{kind}_token_id"), int):
            i = config[f"{kind}_token_id"]
        if i is not None and 0 <= i < n_vocab:
            special_ids[kind] = i
    if spm_style and "unk" not in special_ids and vocab.id_of(model.get("unk_token")) is not None:
        special_ids["unk"] = vocab.id_of(model.get("unk_token"))

    tokens, types, scores = [], [], []
    merge_rank = {}
    merges = _merges(model, where)
    if spm_style:
        for rank, m in enumerate(merges):
            merge_rank.setdefault(m.replace(" ", ""), rank)
    for i in range(n_vocab):
        text = vocab.by_id.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
            scores.append(-1e4)
            continue
        tokens.append(text)
        added = vocab.added.get(i)
        if spm_style and _BYTE_TOKEN.fullmatch(text):
            types.append(TokenType.BYTE)
        elif spm_style and special_ids.get("unk") == i:
            types.append(TokenType.UNKNOWN)
        elif added is not None:
            types.append(TokenType.CONTROL if added.get("special") else TokenType.USER_DEFINED)
        else:
            types.append(TokenType.NORMAL)
        # llama.cpp's SentencePiece merger takes the highest-scoring pair first: the BPE merge
        # order, earliest merge first, is -rank
        scores.append(-float(merge_rank[text]) if text in merge_rank else 0.0)

    if spm_style:
        keys.append(MetaKey(T.MODEL, "llama", V.STRING))
    else:
        keys.append(MetaKey(T.MODEL, "gpt2", V.STRING))
        keys.append(MetaKey(T.PRE, pre_tokenizer_name(tj, where), V.STRING))
    keys.append(MetaKey(T.LIST, tokens, V.ARRAY, V.STRING))
    if spm_style:
        keys.append(MetaKey(T.SCORES, scores, V.ARRAY, V.FLOAT32))
    keys.append(MetaKey(T.TOKEN_TYPE, [int(t) for t in types], V.ARRAY, V.INT32))
    if not spm_style:
        if not merges:
            raise InvalidContentError(about(where, "byte-level BPE tokenizer without merges"))
        keys.append(MetaKey(T.MERGES, merges, V.ARRAY, V.STRING))
    else:
        normalizers = list(_flatten(tj.get("normalizer"), "normalizers"))
        pre = list(_flatten(tj.get("pre_tokenizer"), "pretokenizers"))
        prefix = any(n.get("type") == "Prepend" and n.get("prepend") == "\u2581" for n in normalizers) or \
            any(p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") != "never" for p in pre)
        keys.append(MetaKey(T.ADD_PREFIX, bool(prefix), V.BOOL))

    for kind, key in _SPECIAL_KEYS.items():
        if kind in special_ids:
            keys.append(MetaKey(key, int(special_ids[kind]), V.UINT32))

    first, last = _template_specials(tj)
    bos_text = vocab.by_id.get(special_ids.get("bos", -1))
    eos_text = vocab.by_id.get(special_ids.get("eos", -1))
    add_bos = tc.get("add_bos_token")
    if not isinstance(add_bos, bool):
        add_bos = first is not None and first == bos_text
    add_eos = tc.get("add_eos_token")
    if not isinstance(add_eos, bool):
        add_eos = last is not None and last == eos_text
    if add_bos and "bos" not in special_ids:
        report(f"warning: {where}: add_bos_token is set but there is no BOS token; not adding one")
        add_bos = False
    if add_eos and "eos" not in special_ids:
        add_eos = False
    keys.append(MetaKey(T.ADD_BOS, bool(add_bos), V.BOOL))
    keys.append(MetaKey(T.ADD_EOS, bool(add_eos), V.BOOL))
    keys.extend(_chat_templates(folder, tc))
    return keys

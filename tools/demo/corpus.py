"""Corpus (the running interpreter's standard library), its train/held-out split, and the tokenizer."""
from __future__ import annotations

import hashlib
import json
import platform
import sysconfig
from pathlib import Path

import numpy as np

EOT = "<|endoftext|>"
MASK = "<|mask|>"
SPECIALS = [EOT, MASK]  # ids 0 and 1
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
HELDOUT_PERCENT = 2


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: Path) -> list[str]:
    """Sorted relative paths of *.py under root, without test suites and site-packages."""
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if EXCLUDED_DIRS.intersection(rel.split("/")[:-1]):
            continue
        out.append(rel)
    return sorted(out)


def is_heldout(rel: str) -> bool:
    return int(hashlib.md5(rel.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def describe(root: Path, files: list[str]) -> dict:
    listing = "\n".join(files).encode()
    heldout = [f for f in files if is_heldout(f)]
    return {
        "python_version": platform.python_version(),
        "stdlib_path": str(root),
        "file_count": len(files),
        "file_list_sha256": hashlib.sha256(listing).hexdigest(),
        "total_bytes": sum((root / f).stat().st_size for f in files),
        "heldout_count": len(heldout),
        "heldout_bytes": sum((root / f).stat().st_size for f in heldout),
        "split_rule": f"md5(relative path) % 100 < {HELDOUT_PERCENT} -> held out",
        "excluded_dirs": sorted(EXCLUDED_DIRS),
    }


def read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def train_tokenizer(root: Path, train_files: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # GPT-2 pre-tokenization (its regex plus the byte-level alphabet), no prefix space.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator((read_text(root / f) for f in train_files), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} entries, wanted {vocab_size}")
    if tok.token_to_id(EOT) != 0 or tok.token_to_id(MASK) != 1:
        raise RuntimeError("special tokens did not get ids 0 and 1")
    return tok


def tokenizer_config(max_len: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_len,
        "bos_token": None,
        "eos_token": EOT,
        "pad_token": EOT,
        "unk_token": None,
        "mask_token": MASK,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                     "normalized": False, "single_word": False}
            for i, t in enumerate(SPECIALS)
        },
    }


def encode_files(tok, root: Path, files: list[str]) -> list[np.ndarray]:
    """Token ids per file (uint16), each followed by one <|endoftext|>."""
    texts = [read_text(root / f) for f in files]
    encs = tok.encode_batch(texts, add_special_tokens=False)
    return [np.array(e.ids + [0], dtype=np.uint16) for e in encs]


def save_json(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)


def build_prompts(tok, root: Path, heldout_files: list[str], want: int = 40, per_file: int = 6,
                  min_tokens: int = 48, max_tokens: int = 96) -> list[dict]:
    """Prompts from held-out files: a `def` line plus the start of its body, whole lines only.

    Lines are added until the prompt reaches 64 tokens or the next line would pass max_tokens;
    prompts under min_tokens are dropped. Files are visited round-robin so every file contributes.
    """
    import re

    per_source: list[list[dict]] = []
    for rel in heldout_files:
        lines = read_text(root / rel).splitlines(keepends=True)
        found = []
        for i, line in enumerate(lines):
            if not re.match(r"\s*(async\s+)?def\s", line):
                continue
            text, n = "", 0
            for nxt in lines[i:]:
                m = len(tok.encode(text + nxt, add_special_tokens=False).ids)
                if m > max_tokens:
                    break
                text, n = text + nxt, m
                if n >= 64:
                    break
            if n >= min_tokens:
                found.append({"file": rel, "line": i + 1, "n_tokens": n, "text": text})
        per_source.append(found[:per_file])
    prompts, depth = [], 0
    while len(prompts) < want and any(depth < len(f) for f in per_source):
        for found in per_source:
            if depth < len(found) and len(prompts) < want:
                prompts.append(found[depth])
        depth += 1
    return prompts

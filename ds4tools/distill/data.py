"""Training text: the files of ``--data`` (tokenized with the target's tokenizer, split into train
and held-out), windows of it, and continuations sampled from the target itself
(``--self-generate``: greedy and T = 1, through the engine's decoder). Torch-free.

Held-out split: a file is held out when md5(its path relative to the ``--data`` folder) % 100 < 2,
the bundled demo's rule (tools/demo/corpus.py), so pointing ``--data`` at the demo's corpus
holds out the same files; when that leaves no held-out file (or nothing else), the last 5% of
the token stream is held out instead.
"""
from __future__ import annotations

import fnmatch
import hashlib
import os
from dataclasses import dataclass

import numpy as np

from ..errors import UsageError, about

__all__ = ["Corpus", "collect_files", "load_corpus", "window_starts", "generate_windows",
           "read_eval_prompts", "HELDOUT_PERCENT"]

HELDOUT_PERCENT = 2
#: names never read from a folder (plus hidden files and folders)
SKIPPED_NAMES = ("__pycache__",)
#: text read at most (files in a fixed pseudo-random order until this many bytes)
MAX_BYTES = 256 << 20
_SNIFF = 8192


@dataclass
class SourceFile:
    path: str      # as opened
    rel: str       # relative to the --data folder (the file name for a --data file)


def _is_text(path: str) -> bool:
    try:
        with open(path, "rb") as fh:
            head = fh.read(_SNIFF)
    except OSError:
        return False
    if b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start >= len(head) - 4  # a character cut at the sniff boundary
    return True


def _excluded(rel: str, exclude) -> bool:
    parts = rel.split("/")
    return any(p.startswith(".") or p in SKIPPED_NAMES for p in parts) or any(
        fnmatch.fnmatch(p, pat) for p in parts for pat in exclude)


def collect_files(paths, include=(), exclude=()) -> list[SourceFile]:
    """The text files of ``--data`` (files, or folders read recursively): in a folder, files
    whose name matches an ``include`` glob (any, when none is given), skipping hidden names,
    ``__pycache__``, any path component matching an ``exclude`` glob, and binary files. A
    named file must be text; a folder must hold some."""
    out: list[SourceFile] = []
    for p in paths:
        p = os.fspath(p)
        if os.path.isfile(p):
            if not _is_text(p):
                raise UsageError(about(p, "--data: not a UTF-8 text file"))
            out.append(SourceFile(p, os.path.basename(p)))
        elif os.path.isdir(p):
            found = []
            for root, dirs, files in os.walk(p):
                dirs.sort()
                for name in sorted(files):
                    full = os.path.join(root, name)
                    rel = os.path.relpath(full, p).replace(os.sep, "/")
                    if _excluded(rel, exclude):
                        continue
                    if include and not any(fnmatch.fnmatch(name, pat) for pat in include):
                        continue
                    if os.path.isfile(full) and _is_text(full):
                        found.append(SourceFile(full, rel))
                dirs[:] = [d for d in dirs if not _excluded(
                    os.path.relpath(os.path.join(root, d), p).replace(os.sep, "/"), exclude)]
            if not found:
                raise UsageError(about(p, "--data: the folder holds no text files"
                                          + (f" matching {', '.join(include)}" if include else "")))
            out.extend(found)
        elif not os.path.exists(p):
            raise UsageError(about(p, "--data: no such file or folder"))
        else:
            raise UsageError(about(p, "--data: not a regular file or folder"))
    return out


def is_heldout(rel: str) -> bool:
    return int(hashlib.md5(rel.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


@dataclass
class Corpus:
    train: np.ndarray           # int32 token stream (each file followed by EOS when there is one)
    heldout: np.ndarray         # int32
    files: int
    heldout_files: int
    bytes: int
    split: str                  # how the held-out part was chosen


def load_corpus(files: list[SourceFile], tokenizer, paths) -> Corpus:
    """Tokenize the files (in a fixed pseudo-random order, at most MAX_BYTES) and split them."""
    order = sorted(files, key=lambda f: hashlib.md5(f.rel.encode()).hexdigest())
    texts, rels, total = [], [], 0
    for f in order:
        if total >= MAX_BYTES:
            break
        with open(f.path, "rb") as fh:
            raw = fh.read()
        total += len(raw)
        text = raw.decode("utf-8", errors="replace")
        if text.strip():
            texts.append(text)
            rels.append(f.rel)
    where = ", ".join(os.fspath(p) for p in paths)
    if not texts:
        raise UsageError(f"{where}: --data holds no text (the files are empty)")
    eos = tokenizer.eos_id if tokenizer.eos_id is not None else tokenizer.eot_id
    encoded = tokenizer.tokenizer.encode_batch(texts, add_special_tokens=False)
    arrays = [np.asarray(e.ids + ([eos] if eos is not None else []), np.int32) for e in encoded]
    held = [is_heldout(r) for r in rels]
    n_held = sum(held)
    if 0 < n_held < len(arrays):
        train = np.concatenate([a for a, h in zip(arrays, held) if not h])
        heldout = np.concatenate([a for a, h in zip(arrays, held) if h])
        split = f"files with md5(relative path) % 100 < {HELDOUT_PERCENT} ({n_held} of {len(arrays)})"
    else:
        stream = np.concatenate(arrays)
        cut = len(stream) - max(1, len(stream) // 20)
        train, heldout = stream[:cut], stream[cut:]
        n_held = 0
        split = "the last 5% of the token stream (no file fell in the held-out split)"
    if len(train) < 32:
        raise UsageError(f"{where}: --data gives {len(train)} training tokens; at least 32 are needed")
    return Corpus(train.astype(np.int32), heldout.astype(np.int32), len(arrays), n_held, total, split)


def window_starts(n_tokens: int, seq_len: int, count: int, seed: int) -> np.ndarray:
    """Start offsets of ``count`` training windows of ``seq_len`` tokens, fixed by the seed."""
    rng = np.random.default_rng([seed, 1])
    return rng.integers(0, max(1, n_tokens - seq_len + 1), size=count)


def prompt_length(seq_len: int) -> int:
    return max(8, min(64, seq_len // 4))


def generate_windows(target, train: np.ndarray, seq_len: int, count: int, seed: int, out: np.ndarray,
                     done: int, on_window=None) -> None:
    """Fill ``out`` [count, seq_len] (from row ``done`` on) with self-generated windows: a prompt
    of ``prompt_length`` tokens from the train text, continued by the target to ``seq_len``
    tokens, greedily for even rows and by plain sampling at T = 1 for odd ones (no top-k/p,
    no min-p; end-of-generation tokens do not stop it). Row ``i`` depends only on (seed, i),
    so a resumed run writes the same rows. ``on_window(i)`` after each row."""
    from ..engine.generate import decode
    from ..engine.sampling import Sampler
    model = target.engine.model
    greedy = Sampler(0.0, 0, 1.0, 0.0)
    sampled = Sampler(1.0, 0, 1.0, 0.0)
    p_len = prompt_length(seq_len)
    for i in range(done, count):
        rng = np.random.default_rng([seed, 2, i])
        start = int(rng.integers(0, max(1, len(train) - p_len + 1)))
        prompt = [int(t) for t in train[start:start + p_len]]
        sampler = greedy if i % 2 == 0 else sampled
        toks = list(decode(model, prompt, seq_len - len(prompt), sampler, rng))
        row = np.asarray(prompt + toks, np.int32)
        if len(row) < seq_len:  # the context ran out: repeat the text to fill the window
            row = np.resize(row, seq_len)
        out[i] = row[:seq_len]
        if on_window is not None:
            on_window(i)


def read_eval_prompts(path, tokenizer) -> list[list[int]]:
    """--eval-prompts FILE: a JSON list of strings or of objects with "text" (the demo's
    prompts.json), JSON Lines of the same, or any other text file as one prompt."""
    import json
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as fh:
            raw = fh.read()
    except FileNotFoundError:
        raise UsageError(about(path, "--eval-prompts: no such file")) from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(about(path, f"--eval-prompts: cannot read it as UTF-8 text ({e})")) from None
    items = None
    if path.endswith(".json"):
        try:
            items = json.loads(raw)
        except json.JSONDecodeError as e:
            raise UsageError(about(path, f"--eval-prompts: not valid JSON ({e})")) from None
        if not isinstance(items, list):
            raise UsageError(about(path, "--eval-prompts: expected a JSON list of prompts"))
    elif path.endswith(".jsonl"):
        try:
            items = [json.loads(line) for line in raw.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise UsageError(about(path, f"--eval-prompts: not valid JSON Lines ({e})")) from None
    else:
        items = [raw]
    prompts = []
    for k, item in enumerate(items):
        text = item.get("text") if isinstance(item, dict) else item
        if not isinstance(text, str):
            raise UsageError(about(path, f"--eval-prompts: prompt {k} is not a string (or an "
                                         f"object with a \"text\" string)"))
        ids = tokenizer.encode(text, add_special=True)
        if ids:
            prompts.append(ids)
    if not prompts:
        raise UsageError(about(path, "--eval-prompts: no prompt in the file"))
    return prompts

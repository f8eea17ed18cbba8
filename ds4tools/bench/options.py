"""``BenchOptions``: what ``ds4tools bench`` measures, parsed and checked from the command line's
strings (comma lists, llama-bench style) before anything is loaded. Raises UsageError."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import UsageError
from .sweep import DrafterLists, Setting, expand

DEFAULT_N_PROMPT = 512
DEFAULT_N_GEN = 128
DEFAULT_RK = (1, 2, 4, 8, 16)
DEFAULT_REPEAT = 3


def parse_list(text, option: str, kind=int, minimum=None, maximum=None) -> list | None:
    """``"1,2,4"`` -> [1, 2, 4] (None stays None); one-line UsageError on a bad item."""
    if text is None:
        return None
    what = "integers" if kind is int else "numbers"
    try:
        values = [kind(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{option} {text!r}: expected comma-separated {what}") from None
    if not values:
        raise UsageError(f"{option} {text!r}: expected comma-separated {what}")
    for v in values:
        if kind is float and not math.isfinite(v):
            raise UsageError(f"{option} {text!r}: expected comma-separated {what}")
        if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
            rng = f"at least {minimum:g}" if maximum is None else f"in {minimum:g}..{maximum:g}"
            raise UsageError(f"{option} {v:g}: must be {rng}")
    return list(dict.fromkeys(values))  # order kept, duplicates dropped


@dataclass
class BenchOptions:
    model: str | None = None                 # None: the bundled demo model
    n_prompt: list | None = None             # -p sizes; None: 512, or the --prompt's length
    n_gen: list = field(default_factory=lambda: [DEFAULT_N_GEN])
    rk: list = field(default_factory=lambda: list(DEFAULT_RK))
    threads: int | None = None
    repeat: int = DEFAULT_REPEAT
    prompt: str | None = None                # text; None: synthetic token ids
    exact: bool = False
    cache_type: str = "f32"
    temperatures: list = field(default_factory=lambda: [0.0])
    seed: int = 1234
    drafters: DrafterLists = field(default_factory=DrafterLists)
    progress: bool | None = None             # tqdm on stderr: None = only on a terminal
    settings: list = field(default_factory=list)   # expanded from drafters (check())

    def check(self) -> "BenchOptions":
        """Validate the combination and expand the sweep; returns self. Raises UsageError."""
        if self.repeat < 1:
            raise UsageError(f"--repeat {self.repeat}: must be at least 1")
        if self.seed < 0:
            raise UsageError(f"--seed {self.seed}: must not be negative")
        if self.threads is not None and self.threads < 1:
            raise UsageError(f"--threads {self.threads}: must be at least 1")
        for n in self.n_gen:
            if n == 1:
                raise UsageError("-n 1: must be 0 (no decode test) or at least 2 (decode speed is "
                                 "measured over the tokens after the first)")
        if 1 not in self.rk:
            self.rk = [1] + self.rk
        self.rk = sorted(self.rk)
        self.settings: list[Setting] = expand(self.drafters, self.temperatures)
        if self.settings and not any(self.n_gen):
            raise UsageError("a drafter sweep decodes: give -n N (at least 2)")
        if any(t > 0 for t in self.temperatures) and not self.settings:
            raise UsageError("--temp applies to the drafter sweep (the tg tests are greedy)")
        return self

    @property
    def max_gen(self) -> int:
        return max(self.n_gen)

    @classmethod
    def from_cli(cls, *, model, n_prompt, n_gen, rk, threads, repeat, prompt, prompt_file, exact,
                 cache_type, temp, seed, mtp_file, glm_mtp, dspark, mtp_draft, mtp_margin,
                 dspark_block_size, dspark_confidence, dspark_strict, lookup) -> "BenchOptions":
        """From the command line's raw values (lists as comma-separated strings)."""
        from ..engine.run import read_prompt
        if prompt is not None and prompt_file is not None:
            raise UsageError("give the prompt with --prompt or -f, not both")
        text = read_prompt(prompt, prompt_file) if prompt is not None or prompt_file else None
        if text is not None and not text:
            raise UsageError("the prompt is empty")
        drafters = DrafterLists(
            mtp_file=mtp_file, glm_mtp=glm_mtp, dspark=dspark,
            mtp_draft=parse_list(mtp_draft, "--mtp-draft", int, 1, 16),
            mtp_margin=parse_list(mtp_margin, "--mtp-margin", float, 0),
            dspark_block_size=parse_list(dspark_block_size, "--dspark-block-size", int, 1),
            dspark_confidence=parse_list(dspark_confidence, "--dspark-confidence", float, 0, 1),
            dspark_strict=dspark_strict, lookup=parse_list(lookup, "--lookup", int, 1, 64))
        return cls(
            model=model, n_prompt=parse_list(n_prompt, "-p", int, 0),
            n_gen=parse_list(n_gen, "-n", int, 0) if n_gen is not None else [DEFAULT_N_GEN],
            rk=parse_list(rk, "--rk", int, 1, 256) if rk is not None else list(DEFAULT_RK),
            threads=threads, repeat=DEFAULT_REPEAT if repeat is None else repeat, prompt=text,
            exact=exact, cache_type=cache_type,
            temperatures=parse_list(temp, "--temp", float, 0) if temp is not None else [0.0],
            seed=seed, drafters=drafters).check()

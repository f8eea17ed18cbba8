"""Lossless speculative decoding: drafters propose, the target verifies, a rule accepts.

- ``drafter``: the interface every drafter implements (propose up to k tokens with the
  distribution each was drawn from; observe what was committed).
- ``acceptance``: the rules, pure functions: greedy longest-prefix match, and rejection
  sampling with residual resampling and the bonus token (Leviathan et al., Chen et al.).
- ``lookup``: prompt lookup, the model-free n-gram drafter (llama.cpp's n-gram drafting).
- ``mtp``: the MTP / NextN head, drafting autoregressively on its own hidden state.
- ``dspark``: the DSpark block drafter (one forward per block, Markov head, confidence cut).
- ``decode``: the loop: propose, verify in one batched target forward, accept, commit or roll
  back, with statistics (``stats``).

Greedy output is token-identical to plain greedy decoding because the engine's kernels give a
token the same logits bit for bit whether it is decoded alone or inside a verify batch.
"""
from .acceptance import accept_greedy, accept_sampled
from .decode import speculative_decode
from .drafter import Drafter, Proposal
from .lookup import PromptLookupDrafter
from .stats import SpecStats

__all__ = ["Drafter", "Proposal", "PromptLookupDrafter", "SpecStats", "accept_greedy",
           "accept_sampled", "speculative_decode"]

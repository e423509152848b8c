"""Speculative decoding: a cheap proposer guesses several tokens, the target checks them in one pass.

The pieces here are self-contained (tensors and token lists in, tokens out), so the engine, the tests and
the chapter-04 exercises share them:

* :mod:`minifer.spec.rejection`: verify the drafts, greedily or by lossless rejection sampling;
* :mod:`minifer.spec.ngram`: prompt-lookup (n-gram) proposals, a draft that costs no model at all;
* :mod:`minifer.spec.theory`: expected tokens per target pass and speedup from the acceptance rate.
"""

from minifer.spec.ngram import ngram_propose
from minifer.spec.rejection import one_hot_draft_probs, probs_from_logits, rejection_sample, verify_greedy
from minifer.spec.theory import (acceptance_rate, estimate_alpha, expected_accepted, expected_speedup,
                                 expected_tokens_per_forward, optimal_k)

__all__ = ["verify_greedy", "rejection_sample", "probs_from_logits", "one_hot_draft_probs", "ngram_propose",
           "expected_tokens_per_forward", "expected_accepted", "expected_speedup", "optimal_k",
           "acceptance_rate", "estimate_alpha"]

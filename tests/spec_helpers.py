"""Helpers the speculative-decoding tests share (``tests/spec``, and ``tests/features`` for EAGLE): prompts, the
tokens of outputs, and the chi-squared test of a speculative engine's second sampled token against the target's
exact conditional distribution."""

from __future__ import annotations

import random

import torch
from scipy import stats as scipy_stats

from conftest import minifer_forward
from minifer import LLM, SamplingParams
from minifer.sample.sampler import process_logits

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def mixed_prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [0] + [rng.randrange(1, 2048) for _ in range(rng.randint(1, 40))]} for _ in range(n)]


def story_prompts(stories: list[str], n: int) -> list[str]:
    """Real text, so that the draft agrees with the target often (random tokens would make alpha ~0)."""
    return [" ".join(s.split()[: 4 + i % 9]) for i, s in enumerate(stories[:n])]


def _exact_next(llm: LLM, ids: list[int], params: SamplingParams) -> torch.Tensor:
    """The target's sampling distribution after ``ids`` (temperature, top-p applied exactly as sampled)."""
    logits = minifer_forward(llm, ids)[-1:]
    return process_logits(logits, [params], None).softmax(-1)[0].double()


def _chi2_against(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Chi-squared statistic and degrees of freedom of ``counts`` against ``probs``; cells expected below 5
    are pooled into one (its expected mass is exact, so the test stays exact)."""
    n = counts.sum().item()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].sum().double()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    if obs[~keep].sum() > 0:  # a token the target can never sample was sampled
        return float("inf"), 1
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


def _second_token_test(llm: LLM, target: LLM, prompt: list[int], params: SamplingParams, n: int) -> float:
    """p-value that the second sampled token, given the first, follows the target's exact conditional
    distribution. Token 1 comes from the prompt's forward; token 2 always from a verification step (a
    draft token accepted, or the residual/bonus draw), so this tests the speculative path itself. The
    three most frequent first tokens each give an independent chi-squared test; their sum is one test."""
    outs = llm.generate([{"prompt_token_ids": prompt}] * n,
                        [SamplingParams(temperature=params.temperature, top_p=params.top_p, max_tokens=4,
                                        ignore_eos=True, seed=1000 + i) for i in range(n)], use_tqdm=False)
    pairs = [tuple(o.outputs[0].token_ids[:2]) for o in outs]
    firsts = sorted({a for a, _ in pairs}, key=lambda a: -sum(1 for p in pairs if p[0] == a))
    stat, dof, used = 0.0, 0, 0
    for a in firsts:
        seconds = torch.tensor([b for x, b in pairs if x == a])
        counts = torch.bincount(seconds, minlength=target.model_config.vocab_size)
        s, d = _chi2_against(counts, _exact_next(target, prompt + [a], params))
        if s == float("inf"):
            return 0.0
        if d and used < 3:  # (d == 0: a single possible token, nothing to test beyond the line above)
            stat, dof, used = stat + s, dof + d, used + 1
    assert dof > 0, "no first token left a second token to test"
    return float(scipy_stats.chi2.sf(stat, dof))


PROMPT = [0, 399, 506]  # "The dog" in the bundled tokenizer: several likely next tokens, even with top-p

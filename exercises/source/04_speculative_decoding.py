# Source of exercises/04_speculative_decoding.ipynb and solutions/04_speculative_decoding.ipynb.
# Edit this file, never the notebooks, then run `make exercises` (see exercises/README.md).

# %% [markdown]
# # Exercises 04 · Speculative decoding
#
# Chapter 01 measured why decoding is slow: every new token is one forward pass that reads all of the
# model's weights, and on a GPU that read, not the arithmetic, sets the time. A forward pass over `k + 1`
# positions reads the same weights once, so it costs about as much as a pass over one. **Speculative
# decoding** spends that slack: a cheap **proposer** guesses `k` tokens, and the **target** model scores the
# context plus all `k` guesses in a single pass. Wherever the guesses agree with the target they are kept,
# and several tokens come out of one target pass.
#
# Five pieces of minifer's speculative decoding, rebuilt from scratch:
#
# 1. **greedy verification**: which drafts to keep when the target decodes greedily;
# 2. **rejection sampling**: the same when the target *samples*, without changing what it would have
#    sampled. This is the step that makes the method *lossless*;
# 3. **an n-gram proposer**: guesses copied from the sequence itself, a draft that needs no model;
# 4. (section 5) **the rollback**: what the caches keep of a step's drafts once they are verified;
# 5. (section 6) **the EAGLE head's forward**: a drafter that reads the target's own features.
#
# Each exercise explains the idea, gives a function whose body you write, then a **check cell** that grades
# it against minifer's own (`minifer/sample/rejection_sampler.py`, `minifer/spec_decode/ngram_proposer.py`). A check prints `ok` per
# passing check and stops at the first failure with what differs and a hint.

# %% [markdown] exercise-only
# Run the cells from the top. Stuck? The solved twin is
# [`solutions/04_speculative_decoding.ipynb`](../solutions/04_speculative_decoding.ipynb).

# %% [markdown] solution-only
# *This is the solved twin of
# [`exercises/04_speculative_decoding.ipynb`](../exercises/04_speculative_decoding.ipynb), generated from
# `exercises/source/04_speculative_decoding.py` by `make exercises`: edit the source, not this notebook.*

# %%
import json
from pathlib import Path

import torch

import minifer
from minifer.spec_decode.theory import estimate_alpha, expected_speedup, expected_tokens_per_forward, optimal_k
from minifer.sample.rejection_sampler import rejection_sample as minifer_rejection_sample

torch.set_num_threads(1)

from minifer_course.common import setup_notebook

print(setup_notebook())  # CPU threads (one on a machine of two cores or fewer), quiet progress bars

# %% [markdown]
# ## 1 · One step, and greedy verification
#
# One step of speculative decoding, for a sequence whose tokens so far are the context:
#
# 1. **propose** `k` draft tokens `d_1 … d_k` (a small draft model run `k` times, or a lookup, section 3);
# 2. **score** the context followed by `d_1 … d_k` with the target, in one forward pass. Because attention is
#    causal, the logits at the last context position are the target's prediction for the next token, those
#    at `d_1` its prediction after `d_1`, and so on: `k + 1` predictions, the last one after all `k` drafts;
# 3. **verify**: keep drafts while the target agrees, and always add one token of the target's own.
#
# With greedy decoding the target's prediction at position `j` is `target_argmax[j]`, the argmax of its
# logits there. Draft `d_{j+1}` is right iff it equals `target_argmax[j]`. The first wrong draft is replaced
# by `target_argmax[j]`, which is exactly the token greedy decoding would have produced there, and the step
# stops: the target's predictions after that position were made for a context containing the wrong draft.
# If all `k` drafts are right, the prediction after the last one, `target_argmax[k]`, is a free **bonus**
# token. So a step emits between 1 and `k + 1` tokens, always exactly those plain greedy decoding would
# emit, and costs one target pass plus the proposals.
#
# ```
# drafts          the  cat  sat  on            k = 4
# target_argmax   the  cat  ran  up   .        (5 predictions: after the context, after each draft)
# emitted         the  cat  ran                (2 accepted, then the target's token at the first mismatch)
# ```
#
# The engine verifies a whole batch at once, and the batch is **ragged**: each sequence proposed its own
# number of drafts `k_i` (an n-gram proposer may find nothing, `k_i = 0`). `draft_tokens` is a list of lists,
# and `target_argmax` a `[B, max_k + 1]` tensor in which row `i` uses its first `k_i + 1` columns; the rest
# is padding, whose values mean nothing.
#
# Write `verify_greedy(draft_tokens, target_argmax)`: for each row, the accepted drafts followed by the
# target's token at the first mismatch, or by the bonus `target_argmax[i, k_i]`.

# %%
def verify_greedy(draft_tokens: list[list[int]], target_argmax: torch.Tensor) -> list[list[int]]:
    """Greedy verification of a ragged batch. ``draft_tokens[i]``: the ``k_i`` drafts of row ``i``;
    ``target_argmax`` ``[B, max_k + 1]``: the target's greedy token after the context and each draft.
    Returns per row the emitted tokens (between 1 and ``k_i + 1``)."""
    ### BEGIN SOLUTION
    out = []
    for draft, row in zip(draft_tokens, target_argmax.tolist()):
        n = 0
        while n < len(draft) and draft[n] == row[n]:
            n += 1
        out.append(draft[:n] + [row[n]])  # the target's token at the mismatch, or the bonus when n == k
    return out
    ### END SOLUTION


# %% nbval-check-output
from minifer_course.grading.spec import check_verify_greedy

check_verify_greedy(verify_greedy)

# %% [markdown]
# ### Now your verifier serves the chapter's workload
#
# The next cell saves your `verify_greedy` to `my_engine/verify_greedy.py` (next to this notebook, so it survives
# a kernel restart and the capstone finds it), grades it again, then plugs it into a real engine,
# `LLM("tinystories-target", components=...)`, which serves 8 greedy requests of 16 tokens with n-gram speculation
# (k = 4). Seam: the verifier (`Components.verifier`, vLLM's rejection sampler); your function, which has the
# engine's signature, decides which drafts the engine keeps at every step. Its tokens must be the reference
# engine's, request by request, and transformers' for the first two prompts. A piece that fails its checks never
# reaches the engine: the cell stops with the grader's hint instead.

# %% nbval-check-output
from minifer_course.grading.engine import check_in_engine

check_in_engine("verify_greedy", verify_greedy)

# %% [markdown]
# And its speed: output tokens per second of the engine with your piece, as a ratio of the reference engine's,
# measured in interleaved rounds on this machine (a measurement, not a check: it varies from run to run).

# %%
from minifer_course.workbench import piece_throughput

piece_throughput("verify_greedy", verify_greedy)

# %% [markdown]
# ## 2 · Rejection sampling: speculating without changing the output
#
# With temperature, top-p and the other knobs of chapter 00, the target *samples* each token from a
# distribution `p`, and the draft proposed `d_{j+1}` by sampling from its own distribution `q` at that
# position (after the same temperature and truncation). "Keep the draft if it equals the target's token" no
# longer makes sense; what must hold is that the tokens that come out are **distributed exactly as if the
# target had sampled them itself**. Leviathan et al. and Chen et al. (both 2023) showed how, with a
# modified rejection sampling. For a draft token `x` drawn from `q`:
#
# * **accept** `x` with probability `min(1, p(x) / q(x))`: always when the target likes `x` at least as much
#   as the draft did, less often the more the draft over-proposed it;
# * on **rejection**, draw the replacement from the **residual** `max(p − q, 0)`, normalised, and stop.
#
# Why this gives exactly `p`: token `x` comes out by acceptance with probability
# `q(x) · min(1, p(x) / q(x)) = min(p(x), q(x))`. A rejection happens with probability
# `1 − Σ_y min(p(y), q(y)) = Σ_y max(p(y) − q(y), 0)`, and then `x` is drawn with probability
# `max(p(x) − q(x), 0) / Σ_y max(p(y) − q(y), 0)`: the product is `max(p(x) − q(x), 0)`. The sum of the two
# ways is `min(p(x), q(x)) + max(p(x) − q(x), 0) = p(x)`. The residual gives back exactly the mass that
# acceptance under-delivers. (Drawing the replacement from `p` itself, a common first attempt, counts
# those tokens twice.) The next position is verified only if this one was accepted, given the accepted
# prefix, so by induction the whole output follows the target. A good draft does not change *what* comes
# out, only *how many* tokens a step emits: the acceptance rate is `Σ_x min(p(x), q(x))`.
#
# If all `k` drafts are accepted, the bonus token is sampled from the target's last distribution, `p[k]`.
#
# Write it for **one** sequence: `draft_tokens` (`k` tokens, `k` may be 0), `q` `[k, V]` (the draft's
# distributions), `p` `[k + 1, V]` (the target's), and the sequence's `torch.Generator`. A request with a
# seed must reproduce, so every random number comes from `generator`, in this order (the grader compares
# your tokens with minifer's on fixed seeds):
#
# 1. `u = torch.rand(k, generator=generator)`: all `k` uniforms at once, before looking at any draft;
# 2. accept draft `j` (token `x`) iff `u[j] < p[j, x] / q[j, x]`; the strict `<` never accepts a token the
#    target gives probability 0. If `q[j, x] == 0` (impossible for a token really drawn from `q`, but a
#    caller can be wrong), count it as a rejection instead of dividing by zero;
# 3. exactly one `torch.multinomial(dist, 1, generator=generator)`, where `dist` is
#    `(p[j] − q[j]).clamp(min=0)` at the first rejection `j` (`torch.multinomial` normalises for you), or
#    `p[k]` if all were accepted. If the residual has no mass at all (`p ≤ q` everywhere, which rounding can
#    cause), draw from `p[j]` instead. Keep everything in float32.

# %%
def rejection_sample(draft_tokens: list[int], q: torch.Tensor, p: torch.Tensor,
                     generator: torch.Generator) -> list[int]:
    """Verify one sequence's sampled drafts. ``q`` ``[k, V]``: the draft's distribution at each draft
    token; ``p`` ``[k + 1, V]``: the target's, plus the bonus position. Returns the accepted drafts and one
    more token (from the residual at the first rejection, or the bonus from ``p[k]``)."""
    ### BEGIN SOLUTION
    k = len(draft_tokens)
    u = torch.rand(k, generator=generator)
    for j, x in enumerate(draft_tokens):
        if not (q[j, x] > 0 and u[j] < p[j, x] / q[j, x]):  # rejected: replace x from the residual, stop
            residual = (p[j] - q[j]).clamp(min=0)
            dist = residual if residual.sum() > 0 else p[j]
            return draft_tokens[:j] + [int(torch.multinomial(dist, 1, generator=generator))]
    return draft_tokens + [int(torch.multinomial(p[k], 1, generator=generator))]  # all accepted: the bonus
    ### END SOLUTION


# %% [markdown]
# The check first runs small deterministic cases, then the test that matters: over 3000 sequences speculating
# from the same context, with a draft far from the target, are the first two emitted tokens distributed as
# the target's `p0(y0) · p1(y1 | y0)`? (A chi-squared test: it prints only pass or fail.) Last, it compares
# your tokens with minifer's on the same seeds.

# %% nbval-check-output
from minifer_course.grading.spec import check_rejection_sample

check_rejection_sample(rejection_sample)

# %% [markdown]
# ### Now your rejection sampler serves the chapter's workload
#
# The next cell saves your `rejection_sample` to `my_engine/rejection_sample.py` (next to this notebook, so it
# survives a kernel restart and the capstone finds it), grades it again, then plugs it into a real engine,
# `LLM("tinystories-target", components=...)`, which serves 8 requests sampled at temperature 0.8 with a seed
# each, speculating with n-grams. Seam: the verifier (`Components.verifier`, vLLM's rejection sampler), which
# applies your one-sequence function row by row: it verifies each sequence's drafts, and since it draws the same
# random numbers as minifer's, the same seeds give the same tokens. Its tokens must be the reference engine's,
# request by request. A piece that fails its checks never reaches the engine: the cell stops with the grader's
# hint instead.

# %% nbval-check-output
from minifer_course.grading.engine import check_in_engine

check_in_engine("rejection_sample", rejection_sample)

# %% [markdown]
# And its speed: output tokens per second of the engine with your piece, as a ratio of the reference engine's,
# measured in interleaved rounds on this machine (a measurement, not a check: it varies from run to run).

# %%
from minifer_course.workbench import piece_throughput

piece_throughput("rejection_sample", rejection_sample)

# %% [markdown]
# What losslessness looks like, with minifer's batched `rejection_sample` (the engine's): 20 000 sequences,
# each with its own generator, a target `p` and a draft `q` that barely agree. Most drafts are rejected,
# yet the emitted tokens follow `p`, not `q`:

# %%
def losslessness_demo(n: int = 20_000) -> None:
    p = torch.tensor([[0.50, 0.25, 0.15, 0.10], [0.25, 0.25, 0.25, 0.25]])  # target: position 0, and bonus
    q = torch.tensor([[0.05, 0.05, 0.10, 0.80]])  # a draft that over-proposes token 3
    drafts = torch.multinomial(q[0], n, replacement=True, generator=torch.Generator().manual_seed(0))
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    out = minifer_rejection_sample([[int(d)] for d in drafts], q.expand(n, 1, 4), p.expand(n, 2, 4), gens)
    first = torch.bincount(torch.tensor([o[0] for o in out]), minlength=4) / n
    accepted = sum(len(o) == 2 for o in out) / n
    print("token               0     1     2     3")
    print("draft q          " + "".join(f"{v:6.2f}" for v in q[0].tolist()))
    print("target p         " + "".join(f"{v:6.2f}" for v in p[0].tolist()))
    print("emitted (freq.)  " + "".join(f"{v:6.2f}" for v in first.tolist()))
    print(f"acceptance rate {accepted:.2f}, expected sum(min(p, q)) = {float(torch.minimum(p[0], q[0]).sum()):.2f}")


losslessness_demo()

# %% [markdown]
# ## 3 · Proposals for free: n-gram lookup
#
# A draft model must be trained with the target's tokenizer, loaded, and run `k` times per step. For much
# real text there is a cheaper proposer: **the sequence itself**. Code edits, summaries, answers quoting a
# retrieved document, chats repeating earlier turns: long spans of the output already appear in the context.
# **Prompt-lookup decoding** (Saxena, 2023; vLLM's `"ngram"` speculative method) takes the last `n` tokens as
# a pattern, finds where they occurred before, and proposes the tokens that followed them there.
#
# ```
# tokens     the cat sat on the mat . the cat          (n = 2: the pattern is "the cat")
#            ^^^^^^^                  ^^^^^^^
# proposal   sat on the                                (the k = 3 tokens that followed it before)
# ```
#
# The rules (vLLM's parameters `prompt_lookup_max` and `prompt_lookup_min`):
#
# * try `n` from `prompt_lookup_max` **down to** `prompt_lookup_min`, and use the first `n` whose pattern
#   occurs earlier: a longer match is a more specific context, so its continuation is a better guess;
# * the occurrence must start **before** the pattern itself (the suffix always "matches" itself, and nothing
#   follows it), but it may overlap it: in `a b a b a`, the pattern `a b a` occurred two tokens earlier;
# * of several occurrences take the **most recent** (vLLM takes the earliest; the nearest context tends to be
#   the better guess, and minifer, like this exercise, takes the most recent);
# * propose the tokens right after it, **at most `k`**, fewer where the sequence ends; `[]` if nothing
#   matches (the engine then decodes one token as usual).
#
# Write `ngram_propose`. A plain double loop is fine here; minifer's narrows the candidate positions one
# token at a time with numpy, so a call costs one pass over the sequence.

# %%
def ngram_propose(token_ids: list[int], k: int, prompt_lookup_max: int, prompt_lookup_min: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest suffix of
    ``token_ids`` of length ``prompt_lookup_max`` down to ``prompt_lookup_min``; ``[]`` if none occurs."""
    ### BEGIN SOLUTION
    total = len(token_ids)
    for n in range(prompt_lookup_max, prompt_lookup_min - 1, -1):
        if n >= total:
            continue  # an earlier occurrence needs at least n + 1 tokens
        pattern = token_ids[total - n:]
        for start in range(total - n - 1, -1, -1):  # most recent first, never the suffix itself
            if token_ids[start : start + n] == pattern:
                return token_ids[start + n : start + n + k]
    return []
    ### END SOLUTION


# %% nbval-check-output
from minifer_course.grading.spec import check_ngram_propose

check_ngram_propose(ngram_propose)

# %% [markdown]
# ### Now your n-gram proposer serves the chapter's workload
#
# The next cell saves your `ngram_propose` to `my_engine/ngram_propose.py` (next to this notebook, so it survives
# a kernel restart and the capstone finds it), grades it again, then plugs it into a real engine,
# `LLM("tinystories-target", components=...)`, which serves 8 greedy requests of 16 tokens. Seam: the proposer
# (`Components.proposer`, vLLM's `NgramProposer`): your function proposes the drafts (k = 4, lookup of 3 down to 1
# tokens) that the engine verifies. Its tokens must be the reference
# engine's, request by request, and transformers' for the first two prompts. A piece that fails its checks never
# reaches the engine: the cell stops with the grader's hint instead.

# %% nbval-check-output
from minifer_course.grading.engine import check_in_engine

check_in_engine("ngram_propose", ngram_propose)

# %% [markdown]
# And its speed: output tokens per second of the engine with your piece, as a ratio of the reference engine's,
# measured in interleaved rounds on this machine (a measurement, not a check: it varies from run to run).

# %%
from minifer_course.workbench import piece_throughput

piece_throughput("ngram_propose", ngram_propose)

# %% [markdown]
# ## 4 · How much is it worth?
#
# Model each draft token as accepted independently with probability `α` (the acceptance rate). A step emits
# the accepted drafts plus one target token; the first `i` drafts all survive with probability `α^i`, so the
# expected number of tokens per target pass is the truncated geometric series
#
# `E[tokens] = 1 + α + α² + … + α^k = (1 − α^(k+1)) / (1 − α)`.
#
# Each extra draft token is worth less than the one before it. With `c` the cost of a draft step relative to
# a target step, a speculative step costs `k·c + 1` target steps, and the expected speedup is
# `E[tokens] / (k·c + 1)` (Leviathan et al., 2023). `minifer.spec_decode.theory` has these formulas, and
# `optimal_k` the `k` that maximises the speedup (0: don't speculate).

# %%
print("expected tokens per target pass")
print("alpha    " + "".join(f"  k={k}" for k in (1, 2, 4, 8)))
for alpha in (0.5, 0.7, 0.8, 0.9):
    print(f"{alpha:5.1f}    " + "".join(f"{expected_tokens_per_forward(alpha, k):5.2f}" for k in (1, 2, 4, 8)))

# %% [markdown]
# The bundled pair: along the target's greedy continuations of 16 held-out prompts, the draft's `k = 4`
# greedy proposals had 2.518 tokens accepted on average (`train_report.json`). Under the model that is an
# acceptance rate `α` of about 0.8, and on the 2-core CPU of the README a draft forward costs about a seventh
# of a target forward (0.144 in chapter 04's measurement):

# %%
report = json.loads((Path(minifer.__file__).parent / "assets" / "models" / "train_report.json").read_text())
mean_accepted = report["draft_agreement_k4"]
alpha = estimate_alpha(round(mean_accepted * 1000), 4 * 1000, k=4)  # per-step mean accepted -> per-token alpha
cost = 0.144
best = optimal_k(alpha, cost)
print(f"alpha = {alpha:.3f}")
for k in (1, 2, 4, best):
    print(f"k = {k}: {expected_tokens_per_forward(alpha, k):.2f} tokens per target pass, "
          f"expected speedup {expected_speedup(alpha, k, cost):.2f}x")
print(f"best k for draft cost {cost}: {best}")

# %% [markdown]
# These are upper bounds from an idealised model: the target's verification pass over `k + 1` positions is
# assumed to cost one decode step (true while decoding is memory-bound, less so on a CPU or for large
# batches, where the GPU is already busy), and `α` varies from one context to the next. A measured speedup
# also pays for the proposer's and the engine's bookkeeping: the formula is the ceiling, not the forecast.

# %% [markdown]
# ## 5 · After verification: the rollback
#
# Verification decides how many drafts stay; the caches must then agree with it, or the next step attends to
# keys of tokens that are not in the sequence. Before the step a sequence had `n` tokens, and the target held
# KV for the first `n − 1` (the last token is what the next forward brings). The step placed `k` drafts after
# them, so the target's forward wrote KV for all `n + k` tokens, in block slots reserved for them (chapter 02's
# paged cache: block `block_table[i]` holds tokens `i·block_size … (i+1)·block_size − 1`). Verification
# accepted `accepted` drafts. The rollback:
#
# 1. drops the `k − accepted` rejected drafts from the end of `token_ids`, which keeps `n + accepted` tokens;
# 2. cuts the target's cache back to exactly those tokens, `target.num_tokens = n + accepted`. The token the
#    target emits now (the correction at the first rejection, or the bonus) is appended *after* the rollback,
#    and like any new last token its KV comes with the next forward: keeping one more is the classic off-by-one;
# 3. frees every block the shorter cache no longer reaches: pop it from `block_table`, append it to
#    `free_blocks` (the pool other sequences allocate from). A block half-filled by accepted tokens stays;
# 4. cuts the draft model's cache too, when there is one (`draft` is None for n-grams). The draft fed the
#    context and its first `k − 1` guesses but never its last one (nothing needed that KV yet): it holds
#    `n + k − 1` tokens and keeps `min(draft.num_tokens, n + accepted)`, never more than it computed.
#
# ```
# block_size 4, n = 6 context tokens c, k = 4 drafts d, accepted = 1
# token_ids   c c c c | c c d d | d d      target: 10 tokens in blocks [7, 2, 9]
# after       c c c c | c c d              target:  7 tokens in blocks [7, 2]; block 9 goes to free_blocks
# ```
#
# A `KVView` is one model's cache for one sequence: `num_tokens`, `block_table`, `block_size` and
# `free_blocks`. Write `rollback`: it changes its arguments in place and returns nothing.

# %%
from minifer_course.workbench_spec import KVView


def rollback(token_ids: list[int], k: int, accepted: int, target: KVView, draft: KVView | None) -> None:
    """After verifying the ``k`` drafts at the end of ``token_ids``, of which the first ``accepted`` were kept:
    drop the rejected ones, and cut the target's cache (and the draft's, when there is one) back to the KV of
    the tokens that remain, freeing the blocks that empties."""
    ### BEGIN SOLUTION
    keep = len(token_ids) - k + accepted
    del token_ids[keep:]

    def cut(cache: KVView, num_tokens: int) -> None:
        cache.num_tokens = num_tokens
        while len(cache.block_table) > -(-num_tokens // cache.block_size):  # ceil: the blocks those tokens fill
            cache.free_blocks.append(cache.block_table.pop())

    cut(target, keep)
    if draft is not None:
        cut(draft, min(draft.num_tokens, keep))
    ### END SOLUTION


# %% nbval-check-output
from minifer_course.grading.spec_step import check_rollback

check_rollback(rollback)

# %% [markdown]
# ### Your rollback is graded on its own
#
# The engine has no seam for a rollback (vLLM has none either: the KV cache manager frees what a step did not keep,
# and each proposer trims its own cache), so your `rollback` does not serve requests: it is graded on its own, by the
# check above, against minifer's rule on fixed and random steps. The next cell saves it to `my_engine/rollback.py`
# (next to this notebook, so it survives a kernel restart) and grades it again; the capstone grades it once more
# with your other pieces. In the engine, the same cut is `Speculator.rollback` (`minifer/engine/speculative.py`): the
# allocator's `truncate` and the proposer's `rollback`.

# %% nbval-check-output
from minifer_course.grading.engine import check_on_its_own

check_on_its_own("rollback", rollback)

# %% [markdown]
# ## 6 · A drafter on the target's own features: the EAGLE head
#
# A separate draft model sees only tokens and must rebuild, in its own small width, what the target has
# already computed. EAGLE (Li et al., 2024) drafts from the target's **features** instead: its last hidden
# state `f_t` at position `t`, post-norm, the vector its LM head turns into the next token's distribution.
# minifer ships such a head for the bundled target (`tinystories-target-eagle`, trained by
# `scripts/train_eagle.py`; `speculative_config={"method": "eagle", ...}`, vLLM's name). Its forward, for
# one position:
#
# 1. read a pair: the feature `f_t` of the **previous** position and the token `x_{t+1}` sampled after it
#    (the feature alone does not say which token the sampling picked). The input row is
#    `[f_t, embed(x_{t+1})]`, concatenated in that order (`2·hidden` wide), and a linear map, `head.fc`, fuses
#    it back to `hidden`. The embedding is the target's, `head.embed_tokens`;
# 2. run one Llama decoder layer at the target's width, `head.layer(x, cos, sin, attn)`, rotated for
#    position `t` (`cos, sin = head.rotary(positions, x.dtype)`), attending over the head's own KV cache
#    through `attn` as the target's layers do over theirs;
# 3. apply the head's final RMSNorm, `head.norm`: the output is the predicted `f_{t+1}`, in the post-norm
#    space of the target's features.
#
# The head's own LM head turns the prediction into the draft distribution of `x_{t+2}` (`head.logits`, which the
# proposer applies). It covers a **draft vocabulary**, the target tokens the target itself predicts most often
# (EAGLE-3's `draft_vocab_size`; `head.d2t` maps a draft id back to its target id, as vLLM loads it), and gives
# every other token `-inf`: those are never drafted, and the target's verification keeps the output exact
# anyway. To draft `k` tokens the proposer feeds the head its own predicted feature and the token
# drafted from it, `k` times. Which feature goes with which token is the proposer's job (`EagleProposer`):
# row `i` of `features` is `f_t` for `t = positions[i]`, row `i` of `input_ids` is `x_{t+1}`.
#
# Write `eagle_forward` for `N` packed rows (several positions and sequences at once, as the engine runs it).

# %%
def eagle_forward(head, features: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                  attn) -> torch.Tensor:
    """The EAGLE head's forward: ``features`` ``[N, hidden]`` (``f_t``), ``input_ids`` ``[N]`` (``x_{t+1}``),
    ``positions`` ``[N]`` (``t``), ``attn`` the head's attention backend. Returns the predicted ``f_{t+1}``
    ``[N, hidden]``."""
    ### BEGIN SOLUTION
    x = head.fc(torch.cat([features, head.embed_tokens(input_ids).to(features.dtype)], dim=-1))
    cos, sin = head.rotary(positions, x.dtype)
    return head.norm(head.layer(x, cos, sin, attn))
    ### END SOLUTION


# %% [markdown]
# The check compares your output with the shipped head's along a story, the target's own features fed in
# (teacher-forced, so both heads see the same inputs), then its logits, a forward split in two chunks over a
# cache, and how often its greedy draft is the target's next token. A wrong output is compared with the classic
# mistakes' (the concatenation order, the missing norm, the fusion or the layer skipped) to name the one made.

# %% nbval-check-output
from minifer_course.grading.spec_step import check_eagle_forward

check_eagle_forward(eagle_forward)

# %% [markdown]
# ### Now your EAGLE head serves the chapter's workload
#
# Your function has the signature of `EagleHead.forward` (`head` is its `self`), so it drops in as the head's
# `forward`. Seam: the model class (`Components.model_registry`, as vLLM registers a model for an architecture):
# the engine builds the head from an `EagleHead` subclass whose `forward` is yours. The next cell saves it, grades
# it again and plugs it into the engine, which serves 8 greedy requests of 16 tokens with `speculative_config={"method": "eagle", "model": "tinystories-target-eagle",
# "num_speculative_tokens": 4}`. The tokens alone cannot show a wrong head: whatever it drafts, the target
# verifies, so the output is right either way. What a wrong head changes is how many drafts are accepted, so
# the cell also compares your engine's acceptance rate with that of minifer's head on the same requests.

# %% nbval-check-output
from minifer_course.grading.engine import check_in_engine

check_in_engine("eagle_forward", eagle_forward)

# %%
from minifer_course.workbench import piece_throughput

piece_throughput("eagle_forward", eagle_forward)

# %% [markdown]
# ## Where these live in the engine
#
# * `verify_greedy` is `minifer.sample.rejection_sampler.verify_greedy`, on the same ragged batch;
# * `rejection_sample` is `minifer.sample.rejection_sampler.rejection_sample`, for a ragged batch: the `p(x) / q(x)`
#   of every draft in one gather, the accepted counts of all rows at once, one generator per row in the
#   order of this exercise. `probs_from_logits` applies the sampling knobs to target and draft logits
#   exactly as plain sampling does (a greedy row becomes a one-hot, so rejection sampling reduces to greedy
#   verification), and `one_hot_draft_probs` gives the `q` of a deterministic proposer such as n-grams;
# * `ngram_propose` is `minifer.spec_decode.ngram_proposer.ngram_propose`;
# * the formulas of section 4 are `minifer.spec_decode.theory`;
# * `rollback` is `Speculator.rollback` (`minifer/engine/speculative.py`), with the allocator's `truncate`
#   (`minifer/core/kv_cache_manager.py`) doing the block bookkeeping, prefix-cache entries included;
# * `eagle_forward` is `EagleHead.forward` (`minifer/models/llama_eagle.py`); `EagleProposer`
#   (`minifer/spec_decode/eagle.py`) pairs the features with the tokens and keeps the head's paged cache.

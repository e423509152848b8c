# Source of exercises/03_continuous_batching.ipynb and solutions/03_continuous_batching.ipynb.
# Edit this file, never the notebooks, then run `make exercises` (see exercises/README.md).

# %% [markdown]
# # Exercises 03 · Continuous batching: the scheduler step, preemption, after the forward pass
#
# Chapter 03 decides, before every forward pass, which requests the next step computes, and what happens when the
# KV blocks of exercise 02 run out. Three pieces of the engine, rebuilt from scratch:
#
# 1. **one scheduler step**: continuous batching with a token budget, chunked prefill and preemption;
# 2. **preemption by recompute**: what happens to the request that gives its blocks up;
# 3. **after the forward pass**: the scheduler's `update_from_output`, where every token a request gets is appended
#    and a finished request gives its blocks back.
#
# Each exercise explains the idea, gives a function whose body you write, then a **check cell** that grades it
# against minifer's own (`minifer/core/sched/scheduler.py`) on hand-built cases and random
# ones. A check prints `ok` per passing check and stops at the first failure with what differs and a hint. Each
# piece then serves requests inside a real engine.

# %% [markdown] exercise-only
# Run the cells from the top. Stuck? The solved twin is
# [`solutions/03_continuous_batching.ipynb`](../solutions/03_continuous_batching.ipynb).

# %% [markdown] solution-only
# *This is the solved twin of
# [`exercises/03_continuous_batching.ipynb`](../exercises/03_continuous_batching.ipynb), generated from
# `exercises/source/03_continuous_batching.py` by `make exercises`: edit the source, not this notebook.*

# %%
import math
from collections import deque
from dataclasses import dataclass

from minifer_course.common import show_source
from minifer.core.kv_cache_manager import KVBlockAllocator
from minifer.request import Request, RequestStatus

from minifer_course.common import setup_notebook

print(setup_notebook())  # CPU threads (one on a machine of two cores or fewer), quiet progress bars

# %% [markdown]
# ## 1 · One step of continuous batching
#
# **Static batching** runs a batch until its longest request finishes; the slots of requests that ended
# early sit idle, and new requests wait for the whole batch. **Continuous batching** (Orca, OSDI 2022)
# decides again before *every* forward pass, so a finished request's place is refilled at the next step.
# minifer's `Scheduler.schedule` builds one step within two limits: at most `max_num_seqs` running requests,
# and at most `token_budget` tokens in the forward pass (`max_num_batched_tokens`), which bounds its time
# and activation memory.
#
# The policy, in order:
#
# 1. **Running requests first, oldest first.** Each gets `n = min(num_tokens − num_computed, budget left)`
#    new tokens: 1 for a request that is decoding, the next **chunk** of its prompt for one still in
#    prefill (**chunked prefill**: a long prompt is spread over several steps and shares them with decodes,
#    instead of stalling every decode for one long step). Its KV then needs `ceil((num_computed + n) /
#    block_size)` blocks; it takes the ones it lacks from the free ones. Stop when the budget is spent.
# 2. **Preempt the newest when blocks run out.** If a running request cannot get its blocks, the **newest**
#    running request (the last of `running`) is preempted: its blocks are freed and it goes back to the
#    waiting queue, to be recomputed later from its tokens so far (vLLM's *recompute* preemption). Repeat
#    until the blocks suffice; if the victim is the request itself, stop the loop. Why the newest? It has the
#    least work to lose, and the oldest requests, which have waited longest, keep making progress, so the
#    queue stays first-come-first-served and nothing starves.
# 3. **Admit waiting requests first-come-first-served**, while the budget is not spent, fewer than
#    `max_num_seqs` requests are running, and **no request was preempted in this step** (blocks were short a
#    moment ago: admitting now would just preempt again). Admission allocates blocks for the **whole**
#    prompt, `ceil(num_tokens / block_size)`, even when only its first chunk fits in the budget; if they are
#    not free, stop: the head of the queue is never skipped, or a long request could wait forever behind a
#    stream of short ones. An admitted request gets `min(num_tokens, budget left)` tokens.
#
# A request is a `Request` below (waiting requests have computed nothing and hold no blocks; there is no
# prefix caching in this section). Write `schedule_step`: return `scheduled`, the `(name, new_tokens)` pairs
# in the order above (running ones, then admitted ones), and `preempted`, the names of the preempted requests
# in the order they were preempted. Do not modify the inputs.

# %%
@dataclass(frozen=True)
class Request:
    name: str
    num_tokens: int  # prompt + generated tokens so far
    num_computed: int = 0  # tokens whose KV is already in the cache
    num_blocks: int = 0  # KV blocks it holds now (0 while waiting)


def schedule_step(running: list[Request], waiting: list[Request], free_blocks: int, block_size: int,
                  max_num_seqs: int, token_budget: int) -> tuple[list[tuple[str, int]], list[str]]:
    """One continuous-batching step. ``running``: oldest first; ``waiting``: in arrival order.
    Returns ``(scheduled, preempted)``: ``[(name, num_new_tokens), ...]`` and ``[name, ...]``."""
    ### BEGIN SOLUTION
    running = list(running)  # a copy: preemption removes from it
    scheduled: list[tuple[str, int]] = []
    preempted: list[str] = []
    budget, free = token_budget, free_blocks
    i = 0
    while i < len(running) and budget > 0:
        req = running[i]
        n = min(req.num_tokens - req.num_computed, budget)
        need = math.ceil((req.num_computed + n) / block_size) - req.num_blocks
        while need > free:
            victim = running.pop()  # the newest
            free += victim.num_blocks
            preempted.append(victim.name)
            if victim is req:
                break
        if preempted and preempted[-1] == req.name:
            break  # it preempted itself: nothing newer is left
        free -= max(need, 0)
        scheduled.append((req.name, n))
        budget -= n
        i += 1
    for req in waiting:
        if budget <= 0 or len(running) >= max_num_seqs or preempted:
            break
        need = math.ceil(req.num_tokens / block_size)
        if need > free:
            break  # first-come-first-served: never skip the head of the queue
        free -= need
        n = min(req.num_tokens, budget)
        running.append(req)
        scheduled.append((req.name, n))
        budget -= n
    return scheduled, preempted
    ### END SOLUTION
    ### BEGIN STUB
    running = list(running)  # a copy: preemption removes from it
    scheduled: list[tuple[str, int]] = []
    preempted: list[str] = []
    budget, free = token_budget, free_blocks
    # YOUR CODE HERE: 1-2, the running requests (with preemption); 3, admission
    raise NotImplementedError("implement schedule_step")
    ### END STUB


# %% nbval-check-output
from minifer_course.grading.batching import check_schedule_step

check_schedule_step(schedule_step)

# %% [markdown]
# ### Now your scheduler step serves the chapter's workload
#
# The next cell saves your `schedule_step` to `my_engine/schedule_step.py` (next to this notebook, so it survives
# a kernel restart and the capstone finds it), grades it again, then plugs it into a real engine,
# `LLM("tinystories-target", components=...)` (seam: the scheduler, `Components.scheduler`, vLLM's scheduler
# policy), which serves 8 greedy requests of 32 tokens in a KV cache of only 12 blocks and 64 tokens per step, so requests are preempted and recomputed: every step, the engine describes its
# running and waiting sequences as `Request`s, asks your `schedule_step` who runs, and carries out your plan. Its
# tokens must be the reference engine's, request by request, and transformers' for the first two prompts. A piece
# that fails its checks never reaches the engine: the cell stops with the grader's hint instead.

# %% nbval-check-output
from minifer_course.grading.engine import check_in_engine

check_in_engine("schedule_step", schedule_step)

# %% [markdown]
# And its speed: output tokens per second of the engine with your piece, as a ratio of the reference engine's,
# measured in interleaved rounds on this machine (a measurement, not a check: it varies from run to run).

# %%
from minifer_course.workbench import piece_throughput

piece_throughput("schedule_step", schedule_step)


# %% [markdown]
# ## 2 · Preemption by recompute
#
# Your `schedule_step` decided *who* is preempted; the engine then has to carry it out. A running request holds KV
# blocks for everything it has computed, and when a running request needs a block that is not free, one of them must
# give its blocks up. vLLM's default, **recompute**, frees them outright (its alternative, *swap*, copies them to
# CPU memory first): nothing is kept, so the victim's keys and values will be computed again when it is re-admitted.
# That is cheap to implement and never loses a token, because the victim keeps every token it has: the prompt and the
# tokens it generated so far, together (`seq.all_token_ids`), become the "prompt" it is re-admitted with, so it
# continues exactly where it stopped, only later.
#
# In minifer's `Scheduler`, `schedule` calls `preempt_newest` whenever a running request's blocks run out, which
# calls the scheduler's `preempt(running, waiting, blocks)` and counts the preemption:

# %%
from minifer.core.sched.scheduler import Scheduler

show_source(Scheduler.preempt_newest)

# %% [markdown]
# Write `preempt(running, waiting, blocks)`, returning the sequence it preempted:
#
# 1. **the victim is the newest running request**, the last of `running` (in vLLM's order, as in your
#    `schedule_step`): it has the least work to lose, and the oldest keep their first-come-first-served place;
# 2. take it out of `running` and **free its blocks** (`blocks.free(seq.request_id)`);
# 3. **reset what it has computed**: its `num_computed_tokens` goes back to 0 (no KV of it is left) and its `status`
#    to `RequestStatus.WAITING`; leave its tokens alone;
# 4. put it **at the front** of `waiting` (a `deque`): it arrived before every request still waiting there.

# %%
def preempt(running: list[Request], waiting: deque[Request], blocks: KVBlockAllocator) -> Request:
    """Preempt one running sequence by recomputation: the newest. Returns it."""
    ### BEGIN SOLUTION
    victim = running.pop()
    blocks.free(victim.request_id)
    victim.status, victim.num_computed_tokens = RequestStatus.WAITING, 0
    waiting.appendleft(victim)
    return victim
    ### END SOLUTION


# %% nbval-check-output
from minifer_course.grading.batching import check_preempt

check_preempt(preempt)

# %% [markdown]
# ### Now your preemption serves the chapter's workload
#
# The next cell saves your `preempt` to `my_engine/preempt.py` (next to this notebook, so it survives a kernel
# restart and the capstone finds it), grades it again, then plugs it into a real engine,
# `LLM("tinystories-target", components=...)`, whose scheduler preempts through it (seam: the scheduler,
# `Components.scheduler`, a `Scheduler` whose `preempt` is yours): 8 greedy requests of 32 tokens in
# a KV cache of only 12 blocks and 64 tokens per step, too small for all of them at once. Its tokens must be the
# reference engine's, request by request, and transformers' for the first two prompts; the cell after it counts the
# preemptions, yours against minifer's. A piece that fails its checks never reaches the engine: the cell stops with
# the grader's hint instead.

# %% nbval-check-output
from minifer_course.grading.engine import check_in_engine

check_in_engine("preempt", preempt)

# %% nbval-check-output
from minifer_course.grading.batching import check_preemptions_in_engine

check_preemptions_in_engine(preempt)

# %% [markdown]
# And its speed: output tokens per second of the engine with your piece, as a ratio of the reference engine's,
# measured in interleaved rounds on this machine (a measurement, not a check: it varies from run to run).

# %%
from minifer_course.workbench import piece_throughput

piece_throughput("preempt", preempt)

# %% [markdown]
# ## 3 · After the forward pass: `update_from_output`
#
# Everything so far decides what a step computes; the **engine step** is the loop that drives the parts, once per
# forward pass, for as long as any request is unfinished (`LLM.generate` calls it in a loop; a server calls it as
# requests arrive). minifer's is vLLM's `EngineCore.step` in five lines: the scheduler decides, the model runs, the
# sampler draws, and the scheduler takes the result back:

# %%
from minifer.engine.core import engine_step

show_source(engine_step)

# %% [markdown]
# `rows` are the indices in `batch.seqs` of the sequences whose whole context is now computed: a prompt cut into
# chunks (chunked prefill) has no logits before its last chunk, so it draws no token. The last line is the
# scheduler's second half, `update_from_output(batch, sampled, result, tokenizer)`, and you write it. In order:
#
# 1. **computed**: the forward pass wrote every scheduled token's keys and values into the cache, so add each
#    sequence's new tokens to its `num_computed_tokens` (`zip(batch.seqs, batch.num_new_tokens)`), or the next step
#    would compute them again;
# 2. **append**: `sampled` drew `result`'s tokens, one each, in order (`result.token_ids`, `result.sampled_logprob`,
#    `result.logprobs`); `seq.append_token(token, logprob, entry, tokenizer)` adds one and decides whether the
#    sequence is finished (its stop token, its length);
# 3. **cache**: every scheduled sequence's full, computed blocks are published to the prefix cache, so a later
#    request with the same opening reuses them:
#    `self.blocks.register_computed(seq.request_id, seq.token_slice(0, seq.num_computed_tokens))`;
# 4. **free**: a sampled sequence that finished gives its blocks back, `self.finish(seq)`, last, once nothing else
#    needs them.
#
# Return `sampled` (the engine turns them into the caller's outputs). `self` is the `Scheduler`: `self.blocks` is
# its KV cache manager, `self.finish` takes a sequence out of `running` and frees its blocks.

# %%
from minifer.core.sched.scheduler import ScheduledBatch
from minifer.sample.sampler import SampleResult


def update_from_output(self: Scheduler, batch: ScheduledBatch, sampled: list[Request], result: SampleResult,
                       tokenizer=None) -> list[Request]:
    """After the forward pass: count the scheduled tokens as computed, append the sampled tokens, publish full
    blocks to the prefix cache, free the finished. Returns ``sampled``."""
    ### BEGIN SOLUTION
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
    for seq, token, logprob, entry in zip(sampled, result.token_ids, result.sampled_logprob, result.logprobs):
        seq.append_token(token, logprob, entry, tokenizer)
    for seq in batch.seqs:
        self.blocks.register_computed(seq.request_id, seq.token_slice(0, seq.num_computed_tokens))
    for seq in sampled:
        if seq.is_finished:
            self.finish(seq)
    return sampled
    ### END SOLUTION


# %% [markdown]
# The grader steps two small model-free engines with minifer's `engine_step`, one with minifer's scheduler and one
# whose `update_from_output` is yours (minifer's allocator and sampler around a toy model whose "KV cache" holds token
# ids, so that reading a freed or never-written block changes the tokens, as it would on the real model), and
# compares, after every step, what it returned, every sequence's tokens and computed count, who runs and who waits,
# and the free and cached blocks.

# %% nbval-check-output
from minifer_course.grading.batching import check_update_from_output

check_update_from_output(update_from_output)

# %% [markdown]
# ### Now your `update_from_output` serves the chapter's workload
#
# The next cell saves it to `my_engine/update_from_output.py`, grades it again, then serves the preemption workload
# of section 2 (8 greedy requests of 32 tokens, 12 KV blocks, 64 tokens per step) with a scheduler whose
# `update_from_output` is yours (seam: the scheduler, `Components.scheduler`): every token of every request passes
# through it, and must be the reference engine's, and transformers' for the first two prompts.

# %% nbval-check-output
from minifer_course.grading.engine import check_in_engine

check_in_engine("update_from_output", update_from_output)

# %% [markdown]
# ## Where these live in the engine
#
# * `schedule_step` is `minifer.core.sched.scheduler.Scheduler.schedule`, which works on `Request` objects and
#   the `KVCacheManager` directly: admission asks `can_allocate` (prefix-cache hits included), and a preempted
#   request returns to the *front* of the waiting queue with its generated tokens as part of its prompt;
# * `preempt` is `minifer.core.sched.scheduler.preempt_by_recompute`, the `Scheduler`'s `preempt`;
# * `update_from_output` is `minifer.core.sched.scheduler.Scheduler.update_from_output`, the last line of
#   `minifer.engine.core.engine_step`, the function `LLMEngine.step` (`minifer/engine/llm_engine.py`) runs every
#   step, adding the step's timing and the merging of a request's `n` completions around it; when speculating
#   (chapter 04) the step runs through hooks that propose drafts before the forward and verify them after
#   (`minifer/engine/spec_step.py`).

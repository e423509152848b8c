# Source of exercises/02_kv_cache_and_paging.ipynb and solutions/02_kv_cache_and_paging.ipynb.
# Edit this file, never the notebooks, then run `make exercises` (see exercises/README.md).

# %% [markdown]
# # Exercises 02 · The KV cache in blocks: paging and prefix caching
#
# Chapter 02 cuts the KV cache into fixed-size blocks that any sequence can take, and shares the blocks of
# prompts that start alike. Three pieces of the engine, rebuilt from scratch, and one count:
#
# 1. **slot mapping**: where in the block pool each token's keys and values go;
# 2. **paged attention**: attention that reads its keys and values through a block table;
# 3. **a block allocator with prefix caching**: free list, reference counts, hashed full blocks shared
#    between requests, LRU eviction; then (3b) the blocks that `n` parallel completions of one prompt hold,
#    and (3c) the fork and copy-on-write of beam search.
#
# Each exercise explains the idea, gives a function (or a class) whose body you write, then a **check cell**
# that grades it against minifer's own (`minifer/attention/backends/paged.py`, `minifer/core/kv_cache_manager.py`)
# on hand-built cases and random ones. A check prints `ok` per passing check and stops at the first failure with
# what differs and a hint. Who runs at each step, and what happens when the blocks run out, is exercise 03's.

# %% [markdown] exercise-only
# Run the cells from the top. Stuck? The solved twin is
# [`solutions/02_kv_cache_and_paging.ipynb`](../solutions/02_kv_cache_and_paging.ipynb).

# %% [markdown] solution-only
# *This is the solved twin of
# [`exercises/02_kv_cache_and_paging.ipynb`](../exercises/02_kv_cache_and_paging.ipynb), generated from
# `exercises/source/02_kv_cache_and_paging.py` by `make exercises`: edit the source, not this notebook.*

# %%
import math
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from minifer_course.common import setup_notebook

print(setup_notebook())  # CPU threads (one on a machine of two cores or fewer), quiet progress bars

# %% [markdown]
# ## 1 · Why page the KV cache, and the slot mapping
#
# Every token a sequence has seen leaves a key and a value vector per layer and KV head in the **KV cache**,
# so that decoding the next token does not recompute them. The simplest layout gives each sequence one
# contiguous `[max_len, kv_heads, head_dim]` region, reserved up front because nobody knows how long the
# answer will be. Most of it is never used: a request that stops after 300 of its 4096 reserved tokens
# wastes 93% of its region, and the free memory that remains is cut into pieces too small for a new request.
# The vLLM paper (Kwon et al., SOSP 2023) measured that such systems used only 20–40% of their KV memory for
# actual tokens.
#
# **PagedAttention** borrows the operating system's answer to the same problem, virtual memory. The cache is
# a pool of `num_blocks` **blocks** of `block_size` token slots each (16 in vLLM), stored per layer as
# `[num_blocks, block_size, kv_heads, head_dim]`. Each sequence owns a **block table**: logical block `i` of
# the sequence (its tokens `i·block_size … (i+1)·block_size − 1`) lives in physical block `table[i]`,
# anywhere in the pool. A sequence takes a new block only when its last one is full, so it wastes fewer
# than `block_size` slots, and any free block fits any sequence.
#
# ```
# sequence "the cat sat on the mat ."    block_size 4, block table [7, 2]
#   positions 0..3 -> physical block 7:  slots 28 29 30 31
#   positions 4..6 -> physical block 2:  slots  8  9 10 (11 still free)
# ```
#
# Viewing the pool as one flat array of `num_blocks · block_size` slots, token position `p` of a sequence
# lives in **slot** `table[p // block_size] · block_size + p % block_size`. Before each forward pass the
# engine computes the slot of every new token (the **slot mapping**), and each attention layer writes the
# new keys and values there with one scatter: `k_cache.view(-1, kv_heads, head_dim)[slots] = k`.
#
# Write `slot_mapping(block_table, positions, block_size)`: the slot of each position, in order.

# %%
def slot_mapping(block_table: list[int], positions: list[int], block_size: int) -> list[int]:
    """Cache slot of each token position of one sequence.

    block_table: physical block id of each logical block of the sequence; positions: token positions
    (any order); returns one slot per position: block id * block_size + offset inside the block.
    """
    ### BEGIN SOLUTION
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]
    ### END SOLUTION


# %% nbval-check-output
from minifer_course.grading.paging import check_slot_mapping

check_slot_mapping(slot_mapping)

# %% [markdown]
# ## 2 · Attention over a paged cache
#
# Reading is the mirror image of writing: to attend, a sequence's keys and values are gathered through its
# block table. Write `paged_attention` for **one** sequence in one step:
#
# * `q` `[T, Hq, D]`: the queries of the step's `T` new tokens, which are the **last** `T` positions of a
#   context of `context_len` tokens. `T = context_len` for a whole prompt, `T = 1` for a decode step,
#   anything in between for a chunk of a long prompt (*chunked prefill*, exercise 03);
# * `k_cache`, `v_cache` `[num_blocks, block_size, Hkv, D]`: the pool, already holding the keys and values
#   of all `context_len` positions (this step's included, written through the slot mapping);
# * `block_table`, `context_len`: where the sequence's positions live, and how many there are.
#
# Three details matter:
#
# 1. **The causal mask is offset.** Query `t` sits at position `context_len − T + t` and may see keys
#    `0 … context_len − T + t`. (Masking with `key ≤ t`, as for a whole prompt, is right only when
#    `T = context_len`; a decode query would then see only the first token.)
# 2. **Grouped-query attention.** Models such as Llama 3 and Qwen keep fewer KV heads than query heads:
#    `Hq / Hkv` consecutive query heads share one KV head, so query head `h` reads KV head
#    `h // (Hq // Hkv)` (that is `repeat_interleave` along the head dimension, not `repeat`).
# 3. **Slots outside the context hold garbage.** The pool is shared and never cleared: the unused tail of the
#    last block, and every block of other sequences, hold whatever was written there last, even NaN. A
#    masked score gets softmax weight 0, but `0 · NaN = NaN`, so masking is not enough: read only the
#    `context_len` slots of the sequence (or zero the others).
#
# Scale the scores by `1 / sqrt(D)` and return a tensor like `q` (`[T, Hq, D]`, same dtype). minifer's
# version (`paged_attention_reference`) does the same for a whole ragged batch at once, with the gather
# indices and masks precomputed once per step in `PagedAttentionMetadata`; the GPU path replaces it with a
# Triton kernel that walks the block table without materialising the gathered keys.

# %%
def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: list[int],
                    context_len: int) -> torch.Tensor:
    """Causal attention of one sequence's ``T`` newest queries ``q`` ``[T, Hq, D]`` over its ``context_len``
    cached keys/values, read through ``block_table`` from ``k_cache``/``v_cache``
    ``[num_blocks, block_size, Hkv, D]``. Returns ``[T, Hq, D]`` in ``q``'s dtype."""
    ### BEGIN SOLUTION
    t, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    pos = torch.arange(context_len)
    slots = torch.tensor(block_table)[pos // block_size] * block_size + pos % block_size
    k = k_cache.reshape(-1, hkv, d)[slots]  # [S, Hkv, D]: only the context's slots, no garbage
    v = v_cache.reshape(-1, hkv, d)[slots]
    k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)  # [S, Hq, D]
    scores = torch.einsum("thd,shd->hts", q.float(), k.float()) / math.sqrt(d)  # [Hq, T, S]
    q_pos = context_len - t + torch.arange(t)  # the queries are the last T positions
    causal = pos[None, :] <= q_pos[:, None]  # [T, S]
    scores = scores.masked_fill(~causal, float("-inf"))
    out = torch.einsum("hts,shd->thd", scores.softmax(dim=-1), v.float())
    return out.to(q.dtype)
    ### END SOLUTION


# %% nbval-check-output
from minifer_course.grading.paging import check_paged_attention

check_paged_attention(paged_attention)

# %% [markdown]
# ### Now your paged attention serves the chapter's workload
#
# The next cell saves your `paged_attention` to `my_engine/paged_attention.py` (next to this notebook, so it
# survives a kernel restart and the capstone finds it), grades it again, then plugs it into a real engine,
# `LLM("tinystories-target", components=...)`, which serves 8 greedy requests of 16 tokens. Seam: the attention
# backend (`Components.attention_backend`, vLLM's attention backends): the engine writes each step's keys and values
# into the paged cache and your function reads them back, sequence by sequence, in every
# layer (a Python loop over the batch: slower than minifer's batched version). Its tokens must be the reference
# engine's, request by request, and transformers' for the first two prompts. A piece that fails its checks never
# reaches the engine: the cell stops with the grader's hint instead.

# %% nbval-check-output
from minifer_course.grading.engine import check_in_engine

check_in_engine("paged_attention", paged_attention)

# %% [markdown]
# And its speed: output tokens per second of the engine with your piece, as a ratio of the reference engine's,
# measured in interleaved rounds on this machine (a measurement, not a check: it varies from run to run).

# %%
from minifer_course.workbench import piece_throughput

piece_throughput("paged_attention", paged_attention)

# %% [markdown]
# ## 3 · A block allocator with prefix caching
#
# Block tables have a second benefit: two sequences may point at the **same** physical block. Many requests
# start alike (a system prompt, a few-shot template, the history of a chat), and the keys and values of a
# shared prefix are the same for all of them, so they can be computed once and shared. This is **prefix
# caching** (vLLM's automatic prefix caching, SGLang's RadixAttention).
#
# The allocator's bookkeeping, on integers only (the tensors belong to the model runner):
#
# * **Free list and reference counts.** `ref_count[b]` counts the sequences whose table holds block `b`. A
#   new sequence takes fresh blocks from the free list; freeing a sequence decrements its blocks' counts,
#   and a block whose count reaches 0 is released.
# * **Which blocks can be found.** Only a **full** block whose KV has been **computed** can be shared. Once
#   the engine has run a step, it calls `register_computed(seq_id, tokens)` with all the tokens whose KV is
#   now in the cache, which publishes the sequence's newly full blocks in `cache`, a dict from block hash to
#   block id (given below).
# * **Chained hashes.** A block's keys and values depend on *every* token before it, not only on its own
#   `block_size` tokens, so its identity is a hash of its tokens **and of the previous block's hash**:
#   `h_i = hash((h_{i-1}, tokens of block i))`. Equal hashes then mean equal prefixes, up to collisions.
# * **Verify every hit.** Hashes can collide, and serving another prompt's KV would silently corrupt the
#   output, so a hit counts only if the cached block's stored tokens equal the prompt's.
# * **Never serve the whole prompt from cache.** The forward pass must compute at least the last prompt
#   token: its output is the logits from which the first new token is sampled. If the hits cover the whole
#   prompt (its length is a multiple of `block_size` and every block is cached), give the last hit back;
#   that block is recomputed into a fresh block.
# * **Keep released blocks while memory allows (LRU).** A block that drops to `ref_count` 0 but is in the
#   cache is not wiped: it goes to `evictable`, an `OrderedDict` used as an LRU list (least recently
#   released first), still findable by its hash. A hit on it takes it back out of `evictable`. A fresh block
#   comes from the free list first; only when the free list is empty is the least recently used cached block
#   **evicted**: removed from `cache`, its hash and tokens forgotten, and reused. `free` releases a table
#   from its **last** block to its first, so the tails of sequences are evicted before the prefixes they
#   share with others.
#
# `num_free_blocks` counts both lists, since an evictable block can be handed out at any time. Complete the
# four methods marked *yours*; `can_allocate` and `register_computed` are given, and the engine (and the
# grader) always call `can_allocate` before `allocate`.

# %%
def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """Hash of a full block given the previous block's hash (``None`` for the first block)."""
    return hash((parent, tokens))


class PrefixCachingAllocator:
    def __init__(self, num_blocks: int, block_size: int, hash_fn=chain_hash) -> None:
        self.block_size, self.hash_fn = block_size, hash_fn
        self.ref_count = [0] * num_blocks  # how many sequences hold each block
        self.block_hash: list[int | None] = [None] * num_blocks  # set while a block is in the prefix cache
        self.block_tokens: list[tuple[int, ...]] = [()] * num_blocks  # a cached block's tokens, to verify hits
        self.free_list: deque[int] = deque(range(num_blocks))  # ref 0 and nothing worth keeping
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but cached; least recently used first
        self.cache: dict[int, int] = {}  # block hash -> block id
        self.tables: dict[str, list[int]] = {}  # sequence id -> block table
        self.seq_hashes: dict[str, list[int]] = {}  # sequence id -> chained hashes of its registered full blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_list) + len(self.evictable)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def full_block_hashes(self, tokens: list[int], start: int = 0, parent: int | None = None) -> list[int]:
        """Chained hashes of the full blocks ``start, start+1, ...`` of ``tokens``."""
        bs, hashes = self.block_size, []
        for i in range(start, len(tokens) // bs):
            parent = self.hash_fn(parent, tuple(tokens[i * bs:(i + 1) * bs]))
            hashes.append(parent)
        return hashes

    def can_allocate(self, tokens: list[int]) -> bool:
        hits = self.lookup_prefix(tokens)
        parked = sum(1 for b in hits if self.ref_count[b] == 0)  # counted as free, but about to be reused
        return self.blocks_needed(len(tokens)) - len(hits) <= self.num_free_blocks - parked

    def register_computed(self, seq_id: str, tokens: list[int]) -> None:
        """Publish the sequence's newly full blocks; ``tokens``: all its tokens whose KV is now cached."""
        table, hashes = self.tables[seq_id], self.seq_hashes[seq_id]
        bs = self.block_size
        parent = hashes[-1] if hashes else None
        for i, h in enumerate(self.full_block_hashes(tokens, len(hashes), parent), start=len(hashes)):
            hashes.append(h)
            b = table[i]
            if self.block_hash[b] is not None or h in self.cache:
                continue  # already cached (a shared hit), or the same prefix is cached in another block
            self.block_hash[b], self.block_tokens[b] = h, tuple(tokens[i * bs:(i + 1) * bs])
            self.cache[h] = b

    # --- yours -------------------------------------------------------------------------------------------

    def lookup_prefix(self, tokens: list[int]) -> list[int]:
        """Block ids of the longest cached prefix of ``tokens``: one per full block, stopping at the first
        miss; a hit counts only if the cached block's tokens match. Never the whole prompt (see above)."""
        ### BEGIN SOLUTION
        bs, hits = self.block_size, []
        for i, h in enumerate(self.full_block_hashes(tokens)):
            b = self.cache.get(h)
            if b is None or self.block_tokens[b] != tuple(tokens[i * bs:(i + 1) * bs]):
                break
            hits.append(b)
        if hits and len(hits) * bs >= len(tokens):
            hits.pop()  # the last prompt token must be computed: it yields the logits
        return hits
        ### END SOLUTION
        ### BEGIN STUB
        bs, hits = self.block_size, []
        for i, h in enumerate(self.full_block_hashes(tokens)):
            ...  # YOUR CODE HERE: stop at the first miss (unknown hash, or different tokens)
        ...  # YOUR CODE HERE: never the whole prompt
        raise NotImplementedError("implement PrefixCachingAllocator.lookup_prefix")
        ### END STUB

    def take_free_block(self) -> int:
        """A block for new KV, with ``ref_count`` 1: from the free list if possible, else evict the least
        recently used cached block (forget it in ``cache``, ``block_hash``, ``block_tokens``)."""
        ### BEGIN SOLUTION
        if self.free_list:
            b = self.free_list.popleft()
        else:
            b, _ = self.evictable.popitem(last=False)  # least recently used first
            del self.cache[self.block_hash[b]]
            self.block_hash[b], self.block_tokens[b] = None, ()
        self.ref_count[b] = 1
        return b
        ### END SOLUTION

    def allocate(self, seq_id: str, tokens: list[int]) -> int:
        """Give a new sequence a block table for its prompt: the cached prefix's blocks (shared), then fresh
        blocks. Returns the number of prompt tokens whose KV is already cached."""
        ### BEGIN SOLUTION
        hits = self.lookup_prefix(tokens)
        table = []
        for b in hits:
            if self.ref_count[b] == 0:
                del self.evictable[b]  # parked: in use again
            self.ref_count[b] += 1
            table.append(b)
        while len(table) < self.blocks_needed(len(tokens)):
            table.append(self.take_free_block())
        self.tables[seq_id] = table
        self.seq_hashes[seq_id] = [self.block_hash[b] for b in hits]
        return len(hits) * self.block_size
        ### END SOLUTION
        ### BEGIN STUB
        hits = self.lookup_prefix(tokens)
        table = []
        ...  # YOUR CODE HERE: share the hit blocks (mind the parked ones), then take fresh blocks
        self.tables[seq_id] = table
        self.seq_hashes[seq_id] = [self.block_hash[b] for b in hits]  # register_computed continues from here
        raise NotImplementedError("implement PrefixCachingAllocator.allocate")
        ### END STUB

    def free(self, seq_id: str) -> None:
        """Release a finished (or preempted) sequence's blocks, last block first."""
        ### BEGIN SOLUTION
        table = self.tables.pop(seq_id)
        del self.seq_hashes[seq_id]
        for b in reversed(table):
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                if self.block_hash[b] is not None:
                    self.evictable[b] = None  # most recently released at the end
                else:
                    self.free_list.append(b)
        ### END SOLUTION


# %% [markdown]
# A small run, to see sharing before the grader drives your class through scripted and random sequences of
# operations next to minifer's `KVCacheManager`:

# %%
def demo_prefix_cache(allocator_cls) -> None:
    alloc = allocator_cls(num_blocks=8, block_size=4)
    system = list(range(100, 108))  # an 8-token "system prompt": two full blocks
    print("a cached:", alloc.allocate("a", system + [1, 2, 3]), "table", alloc.tables["a"])
    alloc.register_computed("a", system + [1, 2, 3])  # a's prefill ran: its 2 full blocks are published
    print("b cached:", alloc.allocate("b", system + [4, 5]), "table", alloc.tables["b"])
    alloc.free("a")
    alloc.free("b")
    print("free blocks:", alloc.num_free_blocks, "cached blocks:", len(alloc.cache))

# %% [markdown] exercise-only
# Once your four methods are written, `demo_prefix_cache(PrefixCachingAllocator)` in a new cell should print
#
# ```
# a cached: 0 table [0, 1, 2]
# b cached: 8 table [0, 1, 3]
# free blocks: 8 cached blocks: 2
# ```
#
# (with other block ids if your free list hands them out in another order). `b` shares `a`'s two full
# blocks; after both are freed every block is free again, yet the two blocks of the system prompt are still
# cached for the next request that starts with it.

# %% solution-only
demo_prefix_cache(PrefixCachingAllocator)

# %% [markdown] solution-only
# `b` shares `a`'s two full blocks; after both are freed every block is free again, yet the two blocks of the
# system prompt are still cached for the next request that starts with it.

# %% nbval-check-output
from minifer_course.grading.paging import check_prefix_allocator

check_prefix_allocator(PrefixCachingAllocator)

# %% [markdown]
# ### Now your allocator serves the chapter's workload
#
# The next cell saves your `PrefixCachingAllocator` to `my_engine/PrefixCachingAllocator.py` (next to this
# notebook, so it survives a kernel restart and the capstone finds it), grades it again, then plugs it into a real
# engine, `LLM("tinystories-target", components=...)`, which serves 8 greedy requests of 16 tokens, admitted 4 at
# a time (seam: the block allocator, `Components.block_allocator`, vLLM's KV cache manager over its block pool), three of whose prompts share a story opening longer than a 16-token block: your allocator hands out
# every block table and finds the cached prefixes (growing a table as a sequence decodes takes blocks through your
# `take_free_block`). Its tokens must be the reference engine's, request by request, and transformers' for the
# first two prompts. A piece that fails its checks never reaches the engine: the cell stops with the grader's hint
# instead.

# %% nbval-check-output
from minifer_course.grading.engine import check_in_engine

check_in_engine("PrefixCachingAllocator", PrefixCachingAllocator)

# %% [markdown]
# And its speed: output tokens per second of the engine with your piece, as a ratio of the reference engine's,
# measured in interleaved rounds on this machine (a measurement, not a check: it varies from run to run).

# %%
from minifer_course.workbench import piece_throughput

piece_throughput("PrefixCachingAllocator", PrefixCachingAllocator)

# %% [markdown]
# ## 3b · Parallel sampling, counted in blocks
#
# A request for `n` completions of one prompt (`SamplingParams(n=...)`, chapter 02, section 8) runs as `n`
# sequences with the same prompt. With the prefix cache, the first completion computes the prompt and the others
# take its blocks from the cache; without it, each holds a copy. Write the block count: how many KV blocks the
# `n` completions hold once each has all its `prompt_len + output_len` tokens, with `shared=True` (prefix
# caching) or `shared=False`.
#
# One rule of the allocator above decides the answer: the whole prompt is **never** served from the cache,
# because its last token must be computed (its logits give the first output token). So which of the prompt's
# blocks can a sibling take? Check your count on 16 + 8 tokens in blocks of 8 with `n=4` before running the
# grader, which ends by comparing your count with the blocks the real engine held.

# %%
def parallel_sampling_blocks(prompt_len: int, output_len: int, n: int, block_size: int, shared: bool) -> int:
    """KV blocks held by ``n`` completions of one prompt, each with ``prompt_len + output_len`` tokens."""
    ### BEGIN SOLUTION
    per_completion = -(-(prompt_len + output_len) // block_size)
    if not shared:
        return n * per_completion
    common = (prompt_len - 1) // block_size  # every full block before the one holding the last prompt token
    return common + n * (per_completion - common)
    ### END SOLUTION


# %% nbval-check-output
from minifer_course.grading.paging import check_parallel_sampling_blocks

check_parallel_sampling_blocks(parallel_sampling_blocks)

# %% [markdown]
# ## 3c · Beam search: fork, then copy on write
#
# Beam search (chapter 02, section 9) keeps the `w` best continuations of a prompt. At each step a beam with two
# surviving continuations **forks**: the new beam starts as an exact copy of its parent, every token included. On
# block tables a fork copies no keys or values at all:
#
# * `fork(parent_id, child_id)` gives the child **its own copy** of the parent's table (the same block ids) and
#   of its chained hashes, and adds one reference to every block in it. No block is taken.
# * Shared blocks are read-only. The only block a beam ever writes again is the one its next token goes to: its
#   last, partly filled block (a full block is never written again). Before writing token `position`, the engine
#   calls `copy_on_write(seq_id, position)`. If the block that will hold `position` is shared
#   (`ref_count > 1`), the sequence takes a fresh block (`take_free_block`) in its place, the shared block loses
#   one reference, and the method returns `(shared, fresh)` so that the runner copies the keys and values across.
#   Otherwise it returns `None`: a block only this sequence holds is written in place, and a position past the end
#   of the table needs no copy, because growing the table (`grow`, given) takes a fresh block.
#
# The grader drives your class through scripted cases and random beam searches next to minifer's `KVCacheManager`
# (`fork`, `copy_on_write`), comparing which blocks the beams share, the reference counts and every copy decision.

# %%
class ForkingAllocator(PrefixCachingAllocator):
    def grow(self, seq_id: str, num_tokens: int) -> None:
        """Given: fresh blocks at the end of the table until it holds ``num_tokens`` tokens."""
        table = self.tables[seq_id]
        while len(table) < self.blocks_needed(num_tokens):
            table.append(self.take_free_block())

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares all of the parent's blocks: its own copy of the table and of the chained hashes, and
        one more reference on every block."""
        ### BEGIN SOLUTION
        self.tables[child_id] = list(self.tables[parent_id])
        self.seq_hashes[child_id] = list(self.seq_hashes[parent_id])
        for b in self.tables[child_id]:
            self.ref_count[b] += 1
        ### END SOLUTION

    def copy_on_write(self, seq_id: str, position: int) -> tuple[int, int] | None:
        """Before the sequence writes token ``position``: if that token's block is shared, replace it by a fresh
        block and return ``(shared, fresh)``; otherwise ``None``."""
        ### BEGIN SOLUTION
        table, index = self.tables[seq_id], position // self.block_size
        if index >= len(table) or self.ref_count[table[index]] == 1:
            return None
        shared, fresh = table[index], self.take_free_block()
        self.ref_count[shared] -= 1  # still held by the others: it was shared
        table[index] = fresh
        return shared, fresh
        ### END SOLUTION


# %% nbval-check-output
from minifer_course.grading.paging import check_forking_allocator

check_forking_allocator(ForkingAllocator)

# %% [markdown]
# The capstone (`07_capstone`) uses this class as your engine's allocator (it is your `PrefixCachingAllocator`,
# extended); saving it calls nothing, so this cell also runs before you have written it.

# %%
from minifer_course.workbench import save

save(ForkingAllocator)

# %% [markdown]
# ### Now your forking allocator serves requests that share blocks
#
# The next cell grades your `ForkingAllocator` again, then makes it the allocator of a real engine (the same seam,
# `Components.block_allocator`),
# `LLM("tinystories-target", components=...)`, which serves two workloads whose sequences share blocks: 3 seeded
# completions of each of 8 prompts (parallel sampling: the siblings take the prompt's blocks from your prefix cache)
# and a beam search of width 4 on 2 prompts (the beams fork through your `fork` and copy a shared block through your
# `copy_on_write` before writing into it). Every completion and every beam must be the reference engine's.

# %% nbval-check-output
from minifer_course.grading.forking_engine import check_forking_in_engine

check_forking_in_engine(ForkingAllocator)


# %% [markdown]
# ## Where these live in the engine
#
# * `slot_mapping` is `minifer.attention.backends.paged.slot_mapping`; `PagedAttentionMetadata.build` computes
#   the same for a whole batch in tensors, once per step, together with the gather indices and causal masks;
# * `paged_attention` is `paged_attention_reference` (the CPU path, for a ragged batch); on a GPU, decode
#   steps use the Triton kernels of `minifer/kernels/triton_attention.py`, checked against it;
# * `PrefixCachingAllocator` is `minifer.core.kv_cache_manager.KVCacheManager`, which also grows sequences
#   (`append_slots`) and rolls them back (`truncate`, for speculative decoding);
# * `parallel_sampling_blocks` is `minifer_course.kv_memory.parallel_sampling_blocks`; the sharing itself is
#   `ParentRequest` (`minifer/request.py`) with the prefix cache doing the work.

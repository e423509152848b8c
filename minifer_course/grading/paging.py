"""Graders of exercise 02 (the KV cache in blocks): slot mapping, paged attention, the prefix-caching and forking
allocators, the blocks of parallel sampling."""

from __future__ import annotations

import random
from collections.abc import Callable, Sized
from typing import Any

import torch

from minifer_course.grading.base import Check, as_int_list, assert_close, call_unmodified, randn, run_checks, seeded

# --- slot mapping ---------------------------------------------------------------------

__all__ = ["check_slot_mapping", "check_paged_attention", "check_prefix_allocator", "check_parallel_sampling_blocks",
           "check_forking_allocator"]


def check_slot_mapping(fn: Callable[[list[int], list[int], int], list[int]]) -> None:
    """Grade ``fn(block_table, positions, block_size)`` against
    :func:`minifer.attention.backends.paged.slot_mapping`."""
    from minifer.attention.backends.paged import slot_mapping as ref

    hint = ("position p is slot p % block_size of logical block p // block_size, which lives in physical block "
            "block_table[p // block_size]: slot = block_table[p // block_size] * block_size + p % block_size")

    def diagnose(table: list[int], p: int, bs: int, got: int) -> str:
        suspects = [
            (table[p % bs] * bs + p // bs if p % bs < len(table) else None,
             "`//` and `%` are swapped: p // block_size picks the block, p % block_size the offset inside it"),
            (table[p // bs] + p % bs, "a block id counts blocks, not slots: multiply it by block_size"),
            (p, "you returned the position itself: look its block up in the block table"),
            ((p // bs) * bs + p % bs, "you returned the position itself: look its block up in the block table"),
            (table[p // bs] * bs, "add the offset inside the block, p % block_size"),
        ]
        for value, why in suspects:
            if value == got:
                return why
        return hint

    def case(table: list[int], positions: list[int], bs: int) -> Check:
        def run() -> None:
            table_in, positions_in = list(table), list(positions)
            got = as_int_list(fn(table_in, positions_in, bs), "slot_mapping")
            if table_in != table or positions_in != positions:
                raise AssertionError("your function modified block_table or positions; build a new list instead")
            want = ref(table, positions, bs)
            if len(got) != len(want):
                raise AssertionError(f"returned {len(got)} slots for {len(positions)} positions\nhint: one slot per "
                                     f"position, in the order of `positions`")
            for p, g, w in zip(positions, got, want):
                if g != w:
                    raise AssertionError(
                        f"position {p} (block_size {bs}, block_table {table if len(table) <= 12 else '[...]'}): "
                        f"slot {g}, expected {w}\nhint: {diagnose(table, p, bs, g)}")
        return run

    gen = seeded(3)
    big_table = torch.randperm(64, generator=gen)[:40].tolist()
    big_positions = torch.randint(0, 40 * 16, (300,), generator=gen).tolist()
    checks: list[Check] = [
        ("block_size 4, table [7, 2, 9, 0, 5], positions 0..17", case([7, 2, 9, 0, 5], list(range(18)), 4)),
        ("a prefill chunk: positions 6..12", case([3, 8, 1, 6], list(range(6, 13)), 4)),
        ("one decode token, first slot of its third block", case([11, 4, 30], [32], 16)),
        ("block_size 1: the slot is the block id", case([5, 3, 9, 1], [0, 1, 2, 3], 1)),
        ("no positions: an empty list", case([2, 0], [], 8)),
        ("block_size 16, 40 scattered blocks, 300 positions in any order", case(big_table, big_positions, 16)),
    ]
    run_checks("slot_mapping", checks)


# --- paged attention ------------------------------------------------------------------


def check_paged_attention(fn: Callable[..., torch.Tensor]) -> None:
    """Grade ``fn(q, k_cache, v_cache, block_table, context_len)`` (one sequence's ``T`` new queries, the
    last ``T`` positions of its context) against :func:`minifer.attention.backends.paged.paged_attention_reference`.

    Cache slots outside the sequence's context hold garbage (large random values, or NaN), as in a real
    pool where other sequences and earlier owners wrote them: none of it may change the output."""
    from minifer.attention.backends.paged import (
        PagedAttentionMetadata,
        paged_attention_reference,
    )
    from minifer.attention.backends.paged import slot_mapping as ref_slots

    gen = seeded(4)
    base_hint = ("gather the keys/values of positions 0 .. context_len-1 through the block table, then "
                 "softmax(q·kᵀ / sqrt(head_dim)) · v with query t at position context_len - T + t seeing keys "
                 "0 .. context_len - T + t")

    def case(context_len: int, t: int, hq: int, hkv: int, d: int, bs: int, num_blocks: int, garbage: str = "random",
             hint: str = "") -> Check:
        nblk = -(-context_len // bs)
        table = torch.randperm(num_blocks, generator=gen)[:nblk].tolist()
        k_seq, v_seq = randn(gen, context_len, hkv, d), randn(gen, context_len, hkv, d)
        shape = (num_blocks, bs, hkv, d)
        if garbage == "nan":
            k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
        else:
            k_cache, v_cache = randn(gen, *shape, scale=30.0), randn(gen, *shape, scale=30.0)
        slots = torch.tensor(ref_slots(table, list(range(context_len)), bs))
        k_cache.view(-1, hkv, d)[slots] = k_seq
        v_cache.view(-1, hkv, d)[slots] = v_seq
        q = randn(gen, t, hq, d)
        meta = PagedAttentionMetadata.build([table], [context_len], [t], bs, torch.device("cpu"))
        want = paged_attention_reference(q, k_cache, v_cache, meta)

        def run() -> None:
            got = call_unmodified(fn, q, k_cache, v_cache, list(table), context_len)
            if (isinstance(got, torch.Tensor) and got.shape == want.shape and bool(got.isnan().any())
                    and garbage == "nan"):
                raise AssertionError(
                    "NaN in the output: a slot outside the context leaked in\nhint: gather only positions "
                    "0 .. context_len-1 (or zero the rest): a masked score gives weight 0, but 0 * NaN is NaN")
            assert_close(got, want, atol=1e-5, rtol=1e-4, hint=hint or base_hint)
        return run

    checks: list[Check] = [
        ("prefill: 10 tokens, 2 heads x 16, block_size 4, scattered blocks", case(10, 10, 2, 2, 16, 4, 12)),
        ("decode: 1 query at position 22 of 23", case(
            23, 1, 2, 2, 32, 4, 16, hint="a decode query is the last position and sees every cached key (a mask "
                                         "built as if T = context_len, such as is_causal=True, lets it see key 0 "
                                         "only)")),
        ("chunked prefill: the last 5 of 13 positions", case(
            13, 5, 2, 2, 16, 4, 8, hint="the causal mask is offset: query t sits at position "
                                        "context_len - T + t and sees keys 0 .. context_len - T + t")),
        ("GQA: 6 query heads share 2 KV heads", case(
            9, 3, 6, 2, 8, 2, 10, hint="query head h reads KV head h // (Hq // Hkv): "
                                       "k.repeat_interleave(Hq // Hkv, dim=1), not k.repeat(...)")),
        ("NaN in every unused slot, a half-empty last block", case(11, 4, 4, 2, 16, 4, 9, garbage="nan")),
        ("block_size 1, MQA (4 query heads, 1 KV head)", case(7, 3, 4, 1, 8, 1, 12)),
        ("context of exactly 2 full blocks of 8, NaN elsewhere", case(16, 6, 2, 1, 24, 8, 5, garbage="nan")),
        ("100 tokens over 7 blocks of 16, 4 queries, 8 heads over 2", case(100, 4, 8, 2, 32, 16, 20)),
    ]
    run_checks("paged_attention", checks)


# --- a block allocator with prefix caching -----------------------------------------------


def _allocator_ops_random(seed: int, block_size: int, num_prefixes: int = 3, steps: int = 80) -> list[tuple]:
    """A random script of allocate / register / free operations on prompts that share prefixes."""
    import random

    rng = random.Random(seed)
    prefixes = [[rng.randrange(50) for _ in range(block_size * rng.randrange(0, 4))] for _ in range(num_prefixes)]
    live: dict[str, tuple[list[int], int]] = {}  # seq -> (prompt, tokens registered so far)
    ops: list[tuple] = []
    for n in range(steps):
        r = rng.random()
        if r < 0.45 and len(live) < 6:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 2 * block_size + 2))]
            if rng.random() < 0.2 and live:  # sometimes an exact copy of a live prompt
                prompt = list(rng.choice(list(live.values()))[0])
            seq = f"s{n}"
            ops.append(("allocate", seq, prompt))
            live[seq] = (prompt, 0)
        elif r < 0.75 and live:
            seq = rng.choice(sorted(live))
            prompt, done = live[seq]
            upto = rng.randrange(done, len(prompt) + 1) if rng.random() < 0.5 else len(prompt)
            ops.append(("register", seq, prompt[:upto]))
            live[seq] = (prompt, upto)
        elif live:
            seq = rng.choice(sorted(live))
            ops.append(("free", seq, None))
            del live[seq]
    return ops


def _describe_op(op: tuple) -> str:
    kind, seq, arg = op
    if kind == "free":
        return f"free({seq!r})"
    if kind == "fork":
        return f"fork({arg!r}, {seq!r})"
    if kind == "grow":
        return f"grow({seq!r}, {arg})"
    shown = arg if len(arg) <= 12 else arg[:12] + ["..."]
    return f"{kind}({seq!r}, {len(arg)} tokens {shown})".replace("'...'", "...")


def _drive_allocator(cls: Any, ops: list[tuple], num_blocks: int, block_size: int, hint: str,
                     hash_fn: Callable[[int | None, tuple[int, ...]], int] | None = None) -> None:
    """Run ``ops`` on the learner's allocator and on minifer's KVCacheManager; compare what can be observed."""
    from unittest import mock

    import minifer.core.kv_cache_manager as bm

    with mock.patch.object(bm, "chain_hash", hash_fn or bm.chain_hash):
        ref = bm.KVCacheManager(num_blocks, block_size)
        mine = cls(num_blocks, block_size) if hash_fn is None else cls(num_blocks, block_size, hash_fn=hash_fn)
        history: list[str] = []
        live: set[str] = set()

        def fail(msg: str, why: str = "") -> None:
            shown = history[-8:]
            past = ("\n  ".join((["..."] if len(history) > 8 else []) + shown))
            raise AssertionError(f"{msg}\nafter (num_blocks={num_blocks}, block_size={block_size}):\n  {past}"
                                 f"\nhint: {why or hint}")

        for op in ops:
            kind, seq, tokens = op
            if (tokens not in live) if kind == "fork" else (kind != "allocate" and seq not in live):
                continue  # its allocation did not fit
            if kind == "fork":  # ("fork", child, parent)
                ref.fork(tokens, seq)
                mine.fork(tokens, seq)
                history.append(_describe_op(op))
                live.add(seq)
            elif kind == "cow":  # ("cow", sequence, position)
                _check_copy_on_write(ref, mine, seq, tokens, block_size, history, fail)
            elif kind == "grow":  # ("grow", sequence, tokens it must hold)
                ref.append_slots(seq, tokens)
                mine.grow(seq, tokens)
                history.append(_describe_op(op))
            elif kind == "allocate":
                want_ok, got_ok = ref.can_allocate(tokens), bool(mine.can_allocate(tokens))
                if got_ok != want_ok:
                    history.append(f"can_allocate(... {len(tokens)} tokens)")
                    fail(f"can_allocate says {got_ok}, expected {want_ok} (it uses your lookup_prefix, ref_count "
                         f"and num_free_blocks)")
                if not want_ok:
                    continue
                want, got = ref.allocate(seq, tokens), mine.allocate(seq, tokens)
                history.append(f"{_describe_op(op)} -> {got}")
                live.add(seq)
                if got != want:
                    fail(f"allocate returned {got} cached tokens, expected {want}")
            elif kind == "register":
                ref.register_computed(seq, tokens)
                mine.register_computed(seq, tokens)
                history.append(_describe_op(op))
            else:
                ref.free(seq)
                mine.free(seq)
                history.append(_describe_op(op))
                live.discard(seq)
            if mine.num_free_blocks != ref.num_free_blocks:
                fail(f"num_free_blocks is {mine.num_free_blocks}, expected {ref.num_free_blocks}")
            if len(mine.cache) != ref.num_cached_blocks:
                fail(f"{len(mine.cache)} blocks in the prefix cache, expected {ref.num_cached_blocks}")
            parked = getattr(mine, "evictable", None)
            if isinstance(parked, Sized) and len(parked) != len(ref.block_pool._evictable):
                fail(f"{len(parked)} blocks in `evictable`, expected {len(ref.block_pool._evictable)}",
                     "a block whose ref_count drops to 0 goes to the evictable LRU (`evictable`) if it is cached "
                     "(its block_hash is set), to `free_list` only if it is not: a freed cached block stays "
                     "findable until it is evicted")
            mine_to_ref: dict[int, int] = {}
            ref_to_mine: dict[int, tuple[str, int]] = {}
            for s in sorted(live):
                got_table, want_table = list(mine.tables[s]), ref.block_table(s)
                if len(got_table) != len(want_table):
                    fail(f"sequence {s!r} holds {len(got_table)} blocks, expected {len(want_table)}")
                for i, (g, w) in enumerate(zip(got_table, want_table)):
                    if mine_to_ref.setdefault(g, w) != w:
                        fail(f"block {i} of {s!r} is physical block {g}, which another sequence uses for "
                             f"different tokens: only cached, verified prefix blocks may be shared")
                    if ref_to_mine.setdefault(w, (s, g))[1] != g:
                        other, j = ref_to_mine[w]
                        fail(f"block {i} of {s!r} should share a physical block with {other!r}, but it got block {g} "
                             f"(and {other!r} got {j})")
                    if mine.ref_count[g] != ref.block_pool.blocks[w].ref_count:
                        fail(f"block {g} (block {i} of {s!r}) has ref_count {mine.ref_count[g]}, expected "
                             f"{ref.block_pool.blocks[w].ref_count}")
        if not live and mine.num_free_blocks != num_blocks:
            fail(f"every sequence is freed but only {mine.num_free_blocks} of {num_blocks} blocks are free")


def _check_copy_on_write(ref: Any, mine: Any, seq: str, position: int, block_size: int, history: list[str],
                         fail: Callable[..., None]) -> None:
    """One ``copy_on_write`` on both allocators: the same decision (copy or not), and a pair that names the shared
    block the table held and the fresh block that replaced it."""
    index = position // block_size
    before = list(mine.tables[seq])
    want, got = ref.copy_on_write(seq, position), mine.copy_on_write(seq, position)
    history.append(f"copy_on_write({seq!r}, {position}) -> {got}")
    if want is None and got is not None:
        fail(f"copy_on_write returned {got}, expected None",
             "copy only when another sequence still holds the block (ref_count > 1): its last holder writes in "
             "place, and a position past the end of the table needs no copy (growing the table gives a fresh block)")
    if want is not None and got is None:
        fail(f"copy_on_write returned None, expected a (shared, fresh) pair: block {before[index]} holding position "
             f"{position} is shared",
             "writing into a shared block would change the other sequences' keys and values: take a fresh block "
             "(take_free_block), put it in the table in place of the shared one, drop one reference from the "
             "shared one, and return (shared, fresh) so that the runner copies the KV")
    if got is not None:
        after = mine.tables[seq]
        if not (isinstance(got, tuple) and len(got) == 2) or got != (before[index], after[index]):
            fail(f"copy_on_write returned {got}; expected (the shared block {before[index]}, the fresh block now at "
                 f"index {index} of the table, {after[index]})",
                 "return (shared, fresh) after putting the fresh block in the table in place of the shared one "
                 "(table[index] = fresh): the sequence writes its token into the fresh block")
        if mine.ref_count[got[0]] != ref.block_pool.blocks[want[0]].ref_count:
            fail(f"after the copy, the shared block {got[0]} has ref_count {mine.ref_count[got[0]]}, expected "
                 f"{ref.block_pool.blocks[want[0]].ref_count}",
                 "the sequence no longer holds the shared block: drop one reference from it (the others still hold "
                 "it, so it is not freed)")


def _beam_ops_random(seed: int, block_size: int, width: int, steps: int) -> list[tuple]:
    """A random beam search, as block operations: each step the ``width`` survivors are drawn from the live beams
    (a beam drawn twice forks, one not drawn is freed); each survivor makes the block of its new token its own
    (copy-on-write), grows its table to hold it, and publishes its full blocks."""
    import random

    rng = random.Random(seed)
    prompt = [rng.randrange(50) for _ in range(rng.randrange(1, 3 * block_size))]
    ops: list[tuple] = [("allocate", "b0", prompt), ("register", "b0", prompt)]
    beams = {"b0": prompt}
    count = 1
    for _ in range(steps):
        parents = [rng.choice(sorted(beams)) for _ in range(width)]
        ops += [("free", b, None) for b in sorted(set(beams) - set(parents))]
        new: dict[str, list[int]] = {}
        for parent in parents:
            child = parent if parent not in new else f"b{count}"
            if child != parent:
                count += 1
                ops.append(("fork", child, parent))
            new[child] = beams[parent] + [rng.randrange(50)]
        for beam in rng.sample(sorted(new), len(new)):  # the order decides which sharer copies, not the outcome
            tokens = new[beam]
            ops += [("cow", beam, len(tokens) - 1), ("grow", beam, len(tokens)), ("register", beam, tokens[:-1])]
        beams = new
    return ops + [("free", b, None) for b in sorted(beams)]


def check_forking_allocator(cls: Any) -> None:
    """Grade ``fork`` and ``copy_on_write`` of an allocator class (the prefix-caching allocator plus a given
    ``grow``) against :class:`minifer.core.kv_cache_manager.KVCacheManager`'s, by the same comparison as
    :func:`check_prefix_allocator`: which blocks the sequences share, reference counts, free and cached blocks,
    and each ``copy_on_write`` decision."""
    bs = 4
    p6 = list(range(100, 106))  # one full block of 4 and one holding 2

    def script(ops: list[tuple], num_blocks: int, hint: str, block_size: int = bs) -> Check:
        return lambda: _drive_allocator(cls, ops, num_blocks, block_size, hint)

    def rand(seed: int, block_size: int, width: int, num_blocks: int) -> Check:
        return script(_beam_ops_random(seed, block_size, width, steps=12), num_blocks,
                      "compare with the rules in the notebook: a fork shares every block (own lists, one more "
                      "reference each); copy only a shared block about to be written", block_size)

    checks: list[Check] = [
        ("a fork shares every block: the same blocks, one more reference each, no block taken", script(
            [("allocate", "a", p6), ("fork", "b", "a"), ("fork", "c", "a"), ("free", "a", None)], 8,
            "fork copies the parent's table (the block ids) and adds 1 to the ref_count of every block in it; "
            "freeing the parent then leaves the children's blocks alone")),
        ("the child's table is its own list", script(
            [("allocate", "a", p6), ("fork", "b", "a"), ("grow", "b", 9), ("free", "b", None)], 8,
            "store a copy of the parent's table (list(...)): with the same list object, growing the child's "
            "table grows the parent's too")),
        ("the child's chained hashes are its own list", script(
            [("allocate", "a", p6), ("register", "a", p6), ("fork", "b", "a"), ("cow", "b", 6), ("grow", "a", 8),
             ("grow", "b", 8), ("register", "b", p6 + [7, 8]), ("register", "a", p6 + [5, 5])], 8,
            "copy seq_hashes too (list(...)): register_computed appends to a sequence's hashes, and with a shared "
            "list the parent's next registration starts past blocks it never published")),
        ("a shared block is copied before a write; its last holder writes in place", script(
            [("allocate", "a", p6), ("fork", "b", "a"), ("fork", "c", "a"), ("cow", "b", 6), ("cow", "c", 6),
             ("cow", "a", 6)], 8,
            "copy when ref_count > 1, in place otherwise: the third writer is the block's only holder")),
        ("no copy of a private block, or of a block not allocated yet", script(
            [("allocate", "a", p6 + [1, 2]), ("cow", "a", 7), ("fork", "b", "a"), ("cow", "b", 8), ("grow", "b", 9),
             ("cow", "b", 8)], 8,
            "position // block_size past the end of the table: nothing to copy; a block only this sequence holds: "
            "nothing to copy")),
        ("a copy takes a cached block when the free list is empty", script(
            [("allocate", "x", [7, 7, 7, 7, 1]), ("register", "x", [7, 7, 7, 7, 1]), ("free", "x", None),
             ("allocate", "a", p6), ("fork", "b", "a"), ("cow", "b", 6)], 3,
            "take the fresh block with take_free_block: the free list first, else evict the least recently used "
            "cached block")),
        ("random beam search, width 3, block_size 4", rand(0, 4, 3, 64)),
        ("random beam search, width 4, block_size 2", rand(1, 2, 4, 96)),
        ("random beam search, width 2, block_size 3", rand(2, 3, 2, 64)),
    ]
    run_checks("forking_allocator", checks)


def check_prefix_allocator(cls: Any) -> None:
    """Grade an allocator class (``cls(num_blocks, block_size, hash_fn=...)`` with ``can_allocate``,
    ``allocate``, ``register_computed``, ``free``, ``num_free_blocks``, ``cache``, ``tables``, ``ref_count``)
    by running the same operations on it and on :class:`minifer.core.kv_cache_manager.KVCacheManager` and
    comparing what can be observed: cached-token counts, free and cached block counts, which blocks the
    sequences share (physical ids may differ), reference counts."""
    bs = 4
    p = list(range(100, 112))  # three full blocks of 4

    def script(ops: list[tuple], num_blocks: int, hint: str, block_size: int = bs,
               hash_fn: Callable[[int | None, tuple[int, ...]], int] | None = None) -> Check:
        return lambda: _drive_allocator(cls, ops, num_blocks, block_size, hint, hash_fn)

    def rand(seed: int, block_size: int, num_blocks: int) -> Check:
        ops = _allocator_ops_random(seed, block_size)
        return script(ops, num_blocks, "compare your class with the rules in the notebook: verified hits, last "
                                       "prompt token never cached, tail freed first, LRU eviction only when the "
                                       "free list is empty", block_size)

    checks: list[Check] = [
        ("a new prompt takes ceil(n / block_size) blocks, 0 cached", script(
            [("allocate", "a", list(range(10))), ("allocate", "b", list(range(50, 54))), ("free", "a", None),
             ("free", "b", None)], 8,
            "take blocks_needed(len(tokens)) blocks from the free list; free gives them all back")),
        ("a registered prefix is shared: same physical blocks, ref count 2", script(
            [("allocate", "a", p), ("register", "a", p), ("allocate", "b", p[:8] + [1, 2, 3])], 10,
            "a hit block is reused as is: append its id to the new table and increment its ref_count")),
        ("the last prompt token is never served from cache", script(
            [("allocate", "a", p), ("register", "a", p), ("allocate", "b", p), ("allocate", "c", p + [7])], 12,
            "if the hits cover the whole prompt, drop the last hit: its last token must be computed to get logits")),
        ("only registered (computed) blocks are hits", script(
            [("allocate", "a", p), ("allocate", "b", p), ("register", "a", p[:5]), ("allocate", "c", p)], 12,
            "a block enters the prefix cache only through register_computed, once its KV is written")),
        ("freed blocks come back; cached ones stay findable", script(
            [("allocate", "a", p), ("register", "a", p), ("allocate", "b", p[:8] + [9]), ("free", "a", None),
             ("free", "b", None), ("allocate", "c", p[:4] + [5, 6, 7, 8, 9]), ("free", "c", None)], 6,
            "at ref_count 0 a cached block goes to `evictable` (still in `cache`), an uncached one back to "
            "`free_list`; a hit on a parked block takes it out of `evictable`")),
        ("LRU eviction only when needed; tail blocks go first", script(
            [("allocate", "a", [1, 2, 3, 4]), ("register", "a", [1, 2, 3, 4]), ("free", "a", None),
             ("allocate", "b", [9, 9, 9, 9, 9, 9]), ("free", "b", None), ("allocate", "c", [1, 2, 7])], 4,
            "take from `free_list` first; only when it is empty evict the least recently used cached block "
            "(evictable.popitem(last=False)) and drop it from `cache`; free releases a table from its last "
            "block to its first, so a shared prefix outlives the tails", block_size=2)),
        ("a hash collision is a miss, not a hit on the wrong tokens", script(
            [("allocate", "a", [1, 2, 3]), ("register", "a", [1, 2, 3]), ("allocate", "b", [5, 6, 7]),
             ("allocate", "c", [1, 2, 8])], 8,
            "here every block hashes to 42: compare the cached block's tokens with the prompt's before "
            "counting a hit", block_size=2, hash_fn=lambda parent, tokens: 42)),
        ("a miss ends the prefix, even if a later block is cached", script(
            [("allocate", "a", [1, 2, 3, 4, 5]), ("register", "a", [1, 2, 3, 4, 5]),
             ("allocate", "b", [9, 9, 3, 4, 5])], 8,
            "stop at the first miss (break, not continue): a cached block after a miss holds the KV of other "
            "tokens before it (here the hash ignores the parent, so only the break keeps block 1 of b from "
            "hitting block 1 of a)", block_size=2, hash_fn=lambda parent, tokens: hash(tokens))),
        ("random script, block_size 4, 12 blocks", rand(0, 4, 12)),
        ("random script, block_size 2, 9 blocks", rand(1, 2, 9)),
        ("random script, block_size 3, 16 blocks", rand(5, 3, 16)),
    ]
    run_checks("prefix_allocator", checks)


# --- parallel sampling in blocks -------------------------------------------------------------


def check_parallel_sampling_blocks(fn: Callable[[int, int, int, int, bool], int]) -> None:
    """Grade ``fn(prompt_len, output_len, n, block_size, shared)``, the KV blocks ``n`` completions of one prompt
    hold, against :func:`minifer_course.kv_memory.parallel_sampling_blocks`, then against the engine itself."""
    from minifer_course.kv_memory import blocks_for
    from minifer_course.kv_memory import parallel_sampling_blocks as ref

    def diagnose(p: int, o: int, n: int, bs: int, shared: bool, got: int) -> str:
        own = blocks_for(p + o, bs)
        if not shared:
            if got == ref(p, o, n, bs, True):
                return "shared=False means no prefix cache: every completion holds all of its own blocks"
            return f"without sharing each completion holds ceil((prompt_len + output_len) / block_size) = {own} blocks"
        suspects = [
            (min(p // bs, own) + n * (own - min(p // bs, own)),
             "the block holding the prompt's last token is never taken from the cache: that token is always "
             "computed (its logits give the first output token), so (prompt_len - 1) // block_size blocks are "
             "shared, one fewer than prompt_len // block_size when the prompt fills its blocks exactly"),
            (blocks_for(p, bs) + n * (own - blocks_for(p, bs)),
             "a partly filled block cannot be shared: each completion writes its own tokens after the prompt's"),
            (n * own, "with sharing, the prompt's shared blocks are held once, not once per completion"),
            ((p - 1) // bs + own - (p - 1) // bs, "each of the n completions holds its own blocks after the shared "
                                                  "ones: multiply them by n"),
        ]
        for value, why in suspects:
            if value == got:
                return why
        return ("count the shared blocks once ((prompt_len - 1) // block_size of them) plus, for each of the n "
                "completions, its blocks beyond those")

    def case(p: int, o: int, n: int, bs: int, shared: bool) -> None:
        got = fn(p, o, n, bs, shared)
        if not isinstance(got, int) or isinstance(got, bool):
            raise AssertionError(f"returned {got!r}: return the number of blocks as an int")
        want = ref(p, o, n, bs, shared)
        if got != want:
            raise AssertionError(f"prompt {p}, output {o}, n={n}, block_size {bs}, shared={shared}: {got} blocks, "
                                 f"expected {want}\nhint: {diagnose(p, o, n, bs, shared, got)}")

    def grid() -> None:
        rng = random.Random(7)
        for _ in range(300):
            bs = rng.choice([1, 2, 4, 8, 16, 32])
            case(rng.randint(1, 300), rng.randint(1, 300), rng.randint(1, 9), bs, rng.random() < 0.7)

    def engine() -> None:
        from minifer import LLM
        from minifer_course.kv_memory import measure_parallel_sampling

        llm = LLM("tinystories-draft")
        for (p, o), n, bs in (((40, 8), 3, 8), ((17, 30), 4, 8)):
            r = measure_parallel_sampling(llm, shapes=((p, o),), n_values=(n,), num_prompts=1, block_size=bs)[0]
            for shared, measured in ((True, r["peak_blocks_shared"]), (False, r["peak_blocks_unshared"])):
                got = fn(p, o, n, bs, shared)
                if got != measured:
                    raise AssertionError(f"the engine held at most {measured} blocks for prompt {p}, output {o}, "
                                         f"n={n}, block_size {bs}, shared={shared}; you predict {got}")

    checks: list[Check] = [
        ("no sharing: 3 completions of 20 + 10 tokens, blocks of 8", lambda: case(20, 10, 3, 8, False)),
        ("one completion: sharing changes nothing", lambda: case(20, 10, 1, 8, True)),
        ("a prompt that ends inside a block: 20 + 10 tokens, n=3, blocks of 8", lambda: case(20, 10, 3, 8, True)),
        ("a prompt that fills its blocks exactly: 16 + 8 tokens, n=4, blocks of 8", lambda: case(16, 8, 4, 8, True)),
        ("a prompt shorter than a block: nothing to share", lambda: case(5, 20, 3, 8, True)),
        ("chapter 02's shapes: 256 + 32 and 32 + 128, n=8, blocks of 16",
         lambda: (case(256, 32, 8, 16, True), case(32, 128, 8, 16, True))),
        ("300 random cases", grid),
        ("the engine agrees: its peak blocks in two runs (tinystories-draft)", engine),
    ]
    run_checks("parallel_sampling_blocks", checks)

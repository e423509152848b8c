"""The EAGLE proposer (vLLM's ``"method": "eagle"`` and ``"eagle3"``): the draft head of ``eagle_head.py``
run inside the engine, over its own one-layer paged KV cache.

The head at position ``t`` reads the target's last hidden state ``f_t`` and the token ``x_{t+1}``. The target
computes ``f_t`` in the forwards the engine runs anyway (prefill chunks, decode steps, verifications);
``ModelRunner.hidden_observers`` hands them to ``observe``, which keeps, per request, the features the head has not
read yet. Nothing global: the proposer holds them by request id and drops them on ``release``.

A proposal for a sequence of ``n`` tokens: the head reads ``(f_t, x_{t+1})`` for every unread position up to
``n - 2`` (``f_{n-1}`` comes only with this step's forward); its output there predicts ``f_{n-1}``, whose logits
(``EagleHead.logits``) give the first draft. Draft step ``j`` reads the head's own predicted feature and the draft
before it. Those entries rest on guesses, so the head's cache is cut back to position ``n - 2`` after every
proposal; the next one re-reads the accepted positions with the target's real features (one catch-up chunk per
sequence, batched).

An EAGLE-3 head (``split_eagle3``) reads the inputs of the target layers it names (``aux_hidden_state_layers``)
instead of ``f_t`` and fuses them (``combine_hidden_states``) inside the timed catch-up forward, so the fusion is
part of the head's price. A request whose first positions came from the prefix cache has no features for them: its
head cache starts at the first position with features (``base``). Less context, still lossless: the target
verifies whatever the head drafts.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from minifer.attention.backends.paged import AttentionGroup, PagedAttentionMetadata, PagedKVCache, slot_mapping
from minifer.core.kv_cache_manager import KVBlockAllocator, KVCacheManager, cdiv
from minifer.request import Request
from minifer.spec_decode.metadata import Draft, draw_drafts, stack_probs
from minifer.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from minifer.models.llama_eagle import EagleHead

class KeptFeatures:
    """One request's target features of positions ``p0 .. end - 1`` that the head has not read, as the chunks the
    target's forwards produced. Chunks, not one tensor: while adaptive k holds plain decoding nobody reads them,
    and joining each step's rows onto the whole history (``torch.cat``) would copy a growing tensor every step.
    ``write`` only appends (or trims the tail a rejected draft left); ``take`` joins them once, when the head reads."""

    def __init__(self, p0: int, rows: torch.Tensor) -> None:
        self.p0, self.end, self.chunks = p0, p0 + len(rows), [rows]

    def write(self, start: int, rows: torch.Tensor) -> None:
        """The features of positions ``start ...`` (``p0 <= start <= end``); those kept from ``start`` on go."""
        while self.chunks and self.end - len(self.chunks[-1]) >= start:
            self.end -= len(self.chunks.pop())
        if self.end > start:
            self.chunks[-1] = self.chunks[-1][: start - self.end]
        self.chunks.append(rows)
        self.end = start + len(rows)

    def take(self, start: int, stop: int) -> torch.Tensor:
        """The features of positions ``start .. stop - 1``; everything before ``stop`` is dropped."""
        f = torch.cat(self.chunks) if len(self.chunks) > 1 else self.chunks[0]
        self.chunks, read, self.p0 = [f[stop - self.p0 :]], f[start - self.p0 : stop - self.p0], stop
        return read


def split_eagle3(speculative_config: dict | None) -> tuple[dict | None, bool | None]:
    """vLLM's ``"method": "eagle3"`` (a head fusing low, middle and high target layers) runs on the same proposer as
    ``"eagle"``: it becomes ``"eagle"`` for the engine, and the second value says which kind of head the method
    asks for (True: EAGLE-3, False: EAGLE, None: not an EAGLE method), which ``load_eagle_head`` enforces."""
    if not isinstance(speculative_config, dict) or speculative_config.get("method") not in ("eagle", "eagle3"):
        return speculative_config, None
    if speculative_config["method"] == "eagle":
        return speculative_config, False
    if speculative_config.get("model") is None:
        raise ValueError("method 'eagle3' needs speculative_config['model'] (the fused head, e.g. "
                         "'tinystories-target-eagle3')")
    return {**speculative_config, "method": "eagle"}, True


class EagleProposer:
    """``feats[rid]``: the target's features the head has not read yet (``KeptFeatures``, from position ``p0``);
    ``base[rid]``: the first position of the head's cache; ``computed[rid]``: positions ``base .. computed - 1`` of
    the head's cache hold entries built from real features (the adaptive controller reads ``computed`` too)."""

    def __init__(self, head: EagleHead, target_runner: ModelRunner, num_blocks: int, block_size: int) -> None:
        self.head = head
        cfg, w = head.config, head.fc.weight
        self.target_blocks: KVBlockAllocator = target_runner.blocks
        self.blocks = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.cache = PagedKVCache(1, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, w.dtype, w.device)
        # adaptive k's table of the head's forward time by tokens (``adaptive_k.CostTable``), refreshed by every
        # proposal; None with fixed k
        self.cost = None
        self.forward_s = 0.0  # the head's forwards, in total (the benchmark reads its cost per draft token)
        self.num_forwards = 0
        self.runner = HeadRunner(self)  # what the adaptive controller calibrates and prices, as a draft model's
        self.feats: dict[object, KeptFeatures] = {}
        self.base: dict[object, int] = {}
        self.computed: dict[object, int] = {}
        self.target = target_runner.model.model if head.aux_layers else None  # where an EAGLE-3 head's layers ride
        if self.target is not None:
            if not hasattr(self.target, "aux_hidden_state_layers"):
                raise ValueError(f"the target ({type(self.target).__name__}) cannot expose the layers an EAGLE-3 head "
                                 "reads (aux_hidden_state_layers)")
            # the union: engines that share the target's weights may read other layers (the list is in layer order)
            self.target.aux_hidden_state_layers = tuple(sorted({*self.target.aux_hidden_state_layers,
                                                                *head.aux_layers}))
        target_runner.hidden_observers.append(self.observe)

    # --- the target's features ----------------------------------------------------------------------------

    def observe(self, request_ids: list[object], starts: list[int], tokens: list[list[int]],
                hidden: torch.Tensor) -> None:
        """A target forward ran: keep each chunk's features. A chunk starting at ``start`` overwrites what was kept
        from ``start`` on (the features of rejected drafts); a chunk that does not continue what is kept (the
        request was preempted and recomputed) starts afresh. An EAGLE-3 head keeps the concatenated layers it fuses
        (``[N, 3 * H]``) instead of the last hidden state."""
        # one copy per forward (a replayed CUDA graph overwrites its output); each request keeps a view of it, all
        # the views cut in one call (a Python slice per request would be a loop of tensor views on every held step)
        hidden = self._aux_features(len(hidden)) if self.target is not None else hidden.clone()
        for rid, start, rows in zip(request_ids, starts, hidden.split([len(chunk) for chunk in tokens])):
            kept = self.feats.get(rid)
            if kept is None or not kept.p0 <= start <= kept.end:
                if kept is not None:
                    self.release(rid)
                self.feats[rid] = KeptFeatures(start, rows)
            else:
                kept.write(start, rows)

    def _aux_features(self, rows: int) -> torch.Tensor:
        """This forward's inputs of the head's layers, concatenated; taken, so that a forward that did not run the
        layers (a replayed CUDA graph) cannot hand over a previous forward's."""
        aux, self.target.aux_hidden_states = self.target.aux_hidden_states, None
        layers = self.target.aux_hidden_state_layers
        if aux is None or len(aux) != len(layers) or aux[0].shape[0] != rows:
            raise RuntimeError("the target's forward did not expose the layers the EAGLE-3 head reads "
                               f"({self.head.aux_layers}): CUDA graphs replay without them; use enforce_eager=True")
        return torch.cat([aux[layers.index(i)] for i in self.head.aux_layers], dim=-1)

    def _forget_gone(self) -> None:
        """Features of forwards that were no request's (the adaptive controller's timing runs) are dropped here."""
        for rid in [r for r in self.feats if not self.target_blocks.has_seq(r)]:
            self.release(rid)

    # --- proposing ------------------------------------------------------------------------------------------

    def _prepare(self, seq: Request, k: int) -> bool:
        """The head can draft for ``seq``: the target's features reach position ``n - 2`` and its cache has room for
        the catch-up and ``k - 1`` self-fed positions."""
        rid, n = seq.request_id, seq.num_tokens
        kept = self.feats.get(rid)
        if kept is None or n < 2 or kept.end < n - 1:
            return False
        if rid not in self.computed:
            self.base[rid] = self.computed[rid] = kept.p0
        if not kept.p0 <= self.computed[rid] <= n - 2:
            return False
        entries = n + k - 2 - self.base[rid]
        if not self.blocks.has_seq(rid):
            if cdiv(entries, self.blocks.block_size) > self.blocks.num_free_blocks:
                return False
            self.blocks.allocate(rid, seq.token_slice(0, 1))
        if not self.blocks.can_append(rid, entries):
            return False
        self.blocks.append_slots(rid, entries)
        return True

    def _run(self, rids: list[object], starts: list[int], feats: list[torch.Tensor] | torch.Tensor,
             ids: list[list[int]], bases: list[int] | None = None,
             steps: SelfFedSteps | None = None, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """One head forward over ragged chunks (request ``i``: positions ``starts[i] ...``, its cache from position
        ``bases[i]``, ``self.base`` by default); returns the output of the last position of each chunk ``[len(rids),
        H]`` and its logits. ``steps``: self-fed step ``step`` (one token per request, ``feats`` already packed),
        its attention metadata derived with the proposal's other steps. Timed with the metadata and the LM head,
        which are part of every draft token's price (a draft model's timed forward includes its own); a drafting
        forward (``bases`` None) refreshes the cost table."""
        dev = self.head.fc.weight.device
        lens = [len(c) for c in ids]
        positions = [p for s, m in zip(starts, lens) for p in range(s, s + m)]
        drafting = bases is None
        t0 = time.perf_counter()
        if steps is not None:
            self.cache.meta = steps.meta(step, rids)
        else:
            bases = [self.base[r] for r in rids] if drafting else bases
            self.cache.meta = PagedAttentionMetadata.build(
                [self.blocks.block_table(r) for r in rids], [s + m - b for b, s, m in zip(bases, starts, lens)],
                lens, self.cache.block_size, dev, null_slot=self.cache.null_slot)
        try:
            out = self.head(feats if steps is not None else self.head.combine_hidden_states(torch.cat(feats)),
                            torch.tensor([t for c in ids for t in c], device=dev),
                            torch.tensor(positions, device=dev), self.cache)
        finally:
            self.cache.meta = None
        if steps is None:
            out = out[torch.tensor(lens, device=dev).cumsum(0) - 1]
        logits = self.head.logits(out)
        seconds = time.perf_counter() - t0
        if drafting:
            if self.cost is not None:
                self.cost.observe(len(positions), seconds)
            self.forward_s += seconds
            self.num_forwards += 1
        return out, logits

    @torch.inference_mode()
    def propose(self, seqs: list[Request], ks: list[int], vocab_size: int) -> list[Draft]:
        self._forget_gone()
        drafts = [Draft([]) for _ in seqs]
        active = [i for i, (s, k) in enumerate(zip(seqs, ks)) if k and self._prepare(s, k)]
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        step, out, steps = 0, None, None
        while active:
            rids = [seqs[i].request_id for i in active]
            if step == 0:  # the catch-up chunk: every position whose real feature the head has not read
                starts = [self.computed[r] for r in rids]
                feats = [self._unread(r, seqs[i].num_tokens) for r, i in zip(rids, active)]
                ids = [seqs[i].token_slice(s + 1, seqs[i].num_tokens) for s, i in zip(starts, active)]
            else:  # self-fed: the predicted feature and the draft drawn from it
                starts = [seqs[i].num_tokens - 2 + step for i in active]
                feats, ids = out, [drafts[i].tokens[-1:] for i in active]
                if steps is None:  # every self-fed step's attention bookkeeping, derived once per proposal
                    steps = SelfFedSteps(self, rids, starts, [ks[i] - 1 for i in active])
            out, logits = self._run(rids, starts, feats, ids, steps=steps if step else None, step=step)
            if step == 0:
                for r, i in zip(rids, active):
                    self.computed[r] = seqs[i].num_tokens - 1
            draw_drafts(seqs, active, logits, drafts, probs)
            step += 1
            keep = [r for r, i in enumerate(active) if len(drafts[i].tokens) < ks[i]]
            active, out = [active[r] for r in keep], out[keep]
        for i, s in enumerate(seqs):
            if ks[i] and s.request_id in self.computed:
                self._cut(s.request_id, s.num_tokens - 1)
        return stack_probs(drafts, probs)

    def _unread(self, rid: object, n: int) -> torch.Tensor:
        """The kept features of positions ``computed .. n - 2``; they are read now, so the rest is dropped."""
        return self.feats[rid].take(self.computed[rid], n - 1)

    def _cut(self, rid: object, upto: int) -> None:
        """The head's cache keeps the entries of positions before ``upto`` (built from real features) only."""
        self.computed[rid] = min(self.computed[rid], upto) if rid in self.computed else upto
        if self.blocks.has_seq(rid):
            self.blocks.truncate(rid, max(self.computed[rid] - self.base[rid], 1))

    def rollback(self, seq: Request, num_valid: int) -> None:
        """Nothing to do beyond what ``propose`` did: its cache already stops before the first guessed position."""
        if seq.request_id in self.computed and self.computed[seq.request_id] > num_valid:
            self._cut(seq.request_id, num_valid)

    def release(self, request_id: object) -> None:
        self.feats.pop(request_id, None)
        self.base.pop(request_id, None)
        self.computed.pop(request_id, None)
        if self.blocks.has_seq(request_id):
            self.blocks.free(request_id)


class HeadRunner:
    """The head's forwards behind a draft model runner's interface (``blocks``, ``forward``), so that adaptive k's
    ``calibrate_decode`` times them at start-up and the adaptive controller prices a proposal of
    ``k`` tokens as it prices a draft model's: one catch-up forward and ``k - 1`` self-fed ones of the batch's size
    (without that price the head's drafting would look free)."""

    def __init__(self, proposer: EagleProposer) -> None:
        self.proposer, self.blocks = proposer, proposer.blocks

    def forward(self, request_ids: list[object], starts: list[int], tokens: list[list[int]],
                num_logits: list[int]) -> torch.Tensor:
        """A timing forward over scratch sequences (their caches start at position 0; zero features: the time
        depends on the shapes, not the values); it leaves the cost table and the drafting totals alone."""
        p = self.proposer
        w = p.head.fc.weight
        feats = [torch.zeros(len(c), p.head.feature_size, dtype=w.dtype, device=w.device) for c in tokens]
        with torch.inference_mode():
            return p._run(request_ids, starts, feats, tokens, bases=[0] * len(request_ids))[1]


class SelfFedSteps:
    """The attention metadata of a proposal's self-fed steps, derived together. Step ``j`` (1-based) of request
    ``r`` is one new token at position ``first[r] + j - 1``, its keys the head's cache up to there. ``_prepare``
    allocated every slot the steps write, so the first ``meta`` call gathers every step's key slots once and masks
    the keys past each step's position (they read the null slot, which stays zero); a later step picks its slice
    instead of rebuilding from the block tables (``PagedAttentionMetadata.build``), which is a large share of a
    one-layer head's forward. The work happens inside the first timed step, so the head's price includes it."""

    def __init__(self, proposer: EagleProposer, rids: list[object], first: list[int], steps: list[int]) -> None:
        self.proposer, self.rids, self.first, self.steps = proposer, rids, first, steps
        self.full: list[PagedAttentionMetadata] = []

    def _derive(self) -> None:
        p, dev = self.proposer, self.proposer.head.fc.weight.device
        bs, null = p.cache.block_size, p.cache.null_slot
        base = torch.tensor([p.base[r] for r in self.rids], device=dev)
        tables = [p.blocks.block_table(r) for r in self.rids]
        width = max(len(t) for t in tables)
        self.tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=dev)
        keys = max(f - p.base[r] + m for r, f, m in zip(self.rids, self.first, self.steps))  # the longest last step
        s = torch.arange(keys, device=dev)
        slots = slot_mapping(self.tables, s.clamp(max=width * bs - 1).expand(len(self.rids), -1), bs)
        ctx = (torch.tensor(self.first, device=dev) - base + 1)[None, :] + torch.arange(max(self.steps), device=dev)[:, None]
        self.valid = s[None, None, :] < ctx[:, :, None]  # [steps, b, S]
        self.key_slots = torch.where(self.valid, slots, null)
        self.new = slots.gather(1, (ctx - 1).clamp(max=keys - 1).T).T  # [steps, b]: each step's own slot
        self.ctx = ctx.to(torch.int32)
        self.full = [self._meta(j, None) for j in range(max(self.steps))]

    def _meta(self, j: int, rows: torch.Tensor | None) -> PagedAttentionMetadata:
        pick = (lambda t: t) if rows is None else (lambda t: t[rows])
        valid, key_slots = pick(self.valid[j]), pick(self.key_slots[j])
        b, dev = valid.shape[0], valid.device
        index = torch.arange(b, device=dev)
        group = AttentionGroup(key_slots.reshape(-1), valid[:, :, None, None], valid[:, None, None, :], index[:, None],
                               index, torch.ones(b, 1, dtype=torch.bool, device=dev), b, 1, valid.shape[1], True)
        return PagedAttentionMetadata(pick(self.new[j]), [group], b, pick(self.tables).to(torch.int32),
                                      pick(self.ctx[j]), True, self.proposer.cache.null_slot, True, [1] * b)

    def meta(self, step: int, rids: list[object]) -> PagedAttentionMetadata:
        """The metadata of self-fed step ``step`` (1-based) for ``rids``: the first step's requests or a subset of
        them, in order (those whose proposal is not complete yet)."""
        if not self.full:
            self._derive()
        if len(rids) == len(self.rids):
            return self.full[step - 1]
        at = {r: i for i, r in enumerate(self.rids)}
        return self._meta(step - 1, torch.tensor([at[r] for r in rids], device=self.valid.device))

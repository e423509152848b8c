"""Beam search over the paged KV cache: beams fork by sharing blocks and copy one only when they write to it.

Beam search keeps the ``beam_width`` most likely continuations (*beams*) of a prompt; at every step the best
``beam_width`` proposals over all beams survive, so a beam may fork (several children) or die (none). With a
contiguous cache a fork copies the parent's whole cache (HF's ``reorder_cache`` gathers every layer's keys and
values along the beam axis, every step). On a paged cache a fork copies the parent's *block table* and raises its
blocks' reference counts (``KVCacheManager.fork``), so beams share every block they have in common. Shared blocks
are read-only: a beam's last, partly filled block is copied only when a second sharer is about to write into it
(``KVCacheManager.copy_on_write``, then ``PagedKVCache.copy_blocks``), the vLLM paper's copy-on-write (Kwon et al.
2023, §4.4). Chapter 02 measures what it saves.

The search is HF transformers' ``generate(num_beams=w, early_stopping="never")``, the tests' oracle. Each step:

1. every live beam's continuations are scored by cumulative log-probability, and the top ``K = 2w`` over all
   beams kept (``(1 + number of EOS tokens) * w`` with several EOS tokens, so that at least ``w`` are not EOS);
2. a continuation that ends in EOS or reaches ``max_tokens`` *and* ranks in the top ``w`` becomes a finished
   hypothesis scored ``cum_logprob / num_output_tokens ** length_penalty``; the best ``w`` are kept;
3. the best ``w`` continuations that did not finish are the next beams.

A prompt is done when no live beam can still beat the worst of ``w`` finished hypotheses (``_can_improve``), or
at ``max_tokens``. Prompts are searched side by side: one forward per step carries every live beam of every prompt
under way, and the prefills of prompts just admitted, within the scheduler's token budget. The names are vLLM's;
as in vLLM, a sequence's ``tokens`` hold the prompt too, and its ``text`` is all of them decoded.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from minifer.sample.sampler import ranked_logprobs
from minifer.sampling_params import BeamSearchParams, Logprob


@dataclass
class BeamSearchSequence:
    """One finished beam. ``tokens`` = prompt + output (as in vLLM); ``logprobs`` has one entry per output token."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float
    score: float  # cum_logprob / num_output_tokens ** length_penalty: what the beams are ranked by
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length" (max_tokens or max_model_len)
    stop_reason: int | None = None  # the EOS token id that ended it


@dataclass
class BeamSearchOutput:
    """A prompt's finished beams, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class BeamSearchStats:
    """What the KV cache went through (chapter 02): blocks in the beams' tables vs distinct physical blocks."""

    steps: int = 0
    forks: int = 0  # beams that took a parent's blocks by reference (``KVCacheManager.fork``)
    block_copies: int = 0  # copy-on-write copies of a shared last block
    kv_tokens_copied: int = 0  # the cached tokens those copies carried (at most block_size - 1 each)
    kv_tokens_reordered: int = 0  # what a contiguous cache copies instead: every beam's whole cache, every step
    peak_blocks: int = 0  # most distinct blocks held by live beams at once
    peak_blocks_unshared: int = 0  # most blocks the live beams' tables listed at once (each beam holding its own)
    block_steps_distinct: int = 0  # distinct blocks held, summed over steps
    block_steps_in_tables: int = 0  # blocks listed in tables, summed over steps

    @property
    def memory_saving(self) -> float:
        """The vLLM paper's measure (§6.3): blocks saved by sharing over the blocks held without it."""
        return 1 - self.block_steps_distinct / self.block_steps_in_tables if self.block_steps_in_tables else 0.0


@dataclass
class _Beam:
    seq_id: str
    tokens: list[int]  # prompt + output; the KV of all but the last is in the cache
    cum_logprob: float
    logprobs: list[dict[int, Logprob]]


@dataclass
class _Search:
    """One prompt's search."""

    index: int
    prompt: list[int]
    max_tokens: int  # output tokens allowed (max_tokens, capped by max_model_len)
    bound: int  # the most blocks its beams can ever hold at once (admission reserves it)
    beams: list[_Beam] = field(default_factory=list)
    finished: list[tuple[float, _Beam, str]] = field(default_factory=list)  # (score, beam, reason), best first
    held: set[str] = field(default_factory=set)  # sequence ids that hold blocks
    start: int = 0  # prompt tokens in the cache: prefix hits when admitted, then each prefill chunk
    prefilled: bool = False
    done: bool = False


def blocks_bound(prompt_len: int, max_tokens: int, beam_width: int, block_size: int) -> int:
    """The most KV blocks one prompt's beams can hold at once: the prompt's full blocks, held once (every beam
    descends from the prompt), plus each beam's own blocks for the rest of its ``prompt_len + max_tokens``
    tokens. Beams that share more than the prompt hold fewer."""
    shared = prompt_len // block_size
    return shared + beam_width * (-(-(prompt_len + max_tokens) // block_size) - shared)


class BeamSearch:
    """Runs beam search for a list of prompts on an idle ``LLMEngine``'s runner, block manager and KV cache."""

    def __init__(self, engine, params: BeamSearchParams, eos_token_ids, tokenizer=None,
                 max_model_len: int | None = None, max_num_seqs: int = 16) -> None:
        self.engine, self.params, self.tokenizer = engine, params, tokenizer
        self.blocks, self.runner, self.cache = engine.kv_cache_manager, engine.runner, engine.kv_cache
        self.eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        # prompts searched side by side: their beams fill a batch of max_num_seqs, within the step's token budget (a
        # search's beams always decode together, so a beam_width above max_num_batched_tokens still runs, alone)
        budget = engine.scheduler.config.max_num_batched_tokens
        self.max_active = max(1, min(max_num_seqs, budget) // params.beam_width)
        self.stats = BeamSearchStats()
        self.active: list[_Search] = []  # the prompts under way (what ``on_step`` callbacks look at)
        self.last_forks: list[tuple[str, str]] = []  # the latest step's forks: (child, parent)
        self.last_copies: list[tuple[int, int]] = []  # and its block copies: (source, destination)
        self._ids = 0

    def _new_id(self) -> str:
        self._ids += 1
        return f"beam{self._ids}"

    def plan(self, prompts: list[list[int]]) -> list[_Search]:
        """One search per prompt, checked before anything runs: each must fit the cache on its own."""
        p, bs = self.params, self.blocks.block_size
        searches = []
        for i, prompt in enumerate(prompts):
            room = p.max_tokens if self.max_model_len is None else min(p.max_tokens, self.max_model_len - len(prompt))
            if room < 1:
                raise ValueError(f"prompt {i} has {len(prompt)} tokens: it must be shorter than max_model_len="
                                 f"{self.max_model_len} to leave room for output")
            config = self.engine.scheduler.config
            if not config.enable_chunked_prefill and len(prompt) > config.max_num_batched_tokens:
                raise ValueError(f"prompt {i} has {len(prompt)} tokens, more than max_num_batched_tokens="
                                 f"{config.max_num_batched_tokens} without chunked prefill")
            bound = blocks_bound(len(prompt), room, p.beam_width, bs)
            if bound > self.blocks.num_blocks:
                raise ValueError(f"prompt {i}: {p.beam_width} beams of up to {len(prompt)} + {room} tokens may need "
                                 f"{bound} KV blocks of {bs} tokens, but the cache has {self.blocks.num_blocks}: lower "
                                 f"beam_width or max_tokens, or give the cache more memory")
            searches.append(_Search(i, list(prompt), room, bound))
        return searches

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], on_finish=None, on_step=None) -> list[BeamSearchOutput]:
        """Search every prompt; outputs come back in the order of the prompts. ``on_finish(i)`` is called as
        prompt ``i`` finishes (a progress bar), ``on_step(self)`` after every step (chapter 02's demo)."""
        pending = deque(self.plan(prompts))
        outputs: list[BeamSearchOutput | None] = [None] * len(prompts)
        self.active = active = []
        reserved = 0
        try:
            while pending or active:
                # Admission reserves each prompt's worst case (``blocks_bound``), so a search never waits for
                # blocks mid-way and nothing is ever preempted.
                while (pending and len(active) < self.max_active
                       and reserved + pending[0].bound <= self.blocks.num_blocks):
                    search = pending.popleft()
                    self._admit(search)
                    active.append(search)
                    reserved += search.bound
                self._step(active)
                if on_step is not None:
                    on_step(self)
                for search in [s for s in active if s.done]:
                    active.remove(search)
                    reserved -= search.bound
                    outputs[search.index] = self._output(search)
                    if on_finish is not None:
                        on_finish(search.index)
        finally:  # an error (or an interrupt) must not strand blocks in the engine's pool
            for search in active:
                self._release(search)
        return outputs  # type: ignore[return-value]

    def _admit(self, search: _Search) -> None:
        beam = _Beam(self._new_id(), list(search.prompt), 0.0, [])
        search.start = self.blocks.allocate(beam.seq_id, beam.tokens)
        search.held.add(beam.seq_id)
        search.beams = [beam]

    def _release(self, search: _Search) -> None:
        for seq_id in search.held:
            self.blocks.free(seq_id)
        search.held.clear()

    # --- one step ----------------------------------------------------------------------------------------

    def _step(self, active: list[_Search]) -> None:
        """One forward: one token for every live beam, plus as much of the prompts still being prefilled as the
        step's token budget leaves (``max_num_batched_tokens``; split across steps with chunked prefill, as the
        scheduler does). Then every search whose logits came back selects, and moves its blocks; the copy-on-write
        copies run together before the next forward writes anything."""
        ids, starts, chunks, num_logits, selecting = self._pack(active)
        logprobs = torch.log_softmax(self.runner.forward(ids, starts, chunks, num_logits).float(), dim=-1)
        for search in active:  # publish the blocks this step filled, for later prompts that share them
            for beam in search.beams:
                self.blocks.register_computed(beam.seq_id, beam.tokens[: search.start] if not search.prefilled
                                              else beam.tokens)
        row, copies = 0, []
        self.last_forks = []
        for search in selecting:
            parents = search.beams
            search.prefilled = True
            self._select(search, logprobs[row : row + len(parents)])
            row += len(parents)
            if search.done:
                self._release(search)
            else:
                copies += self._place(search, {b.seq_id for b in parents})
        self.cache.copy_blocks(copies)
        self.last_copies = copies
        self.stats.block_copies += len(copies)
        self.stats.steps += 1
        self._count_blocks([s for s in active if not s.done])

    def _pack(self, active: list[_Search]) -> tuple[list, list, list, list, list[_Search]]:
        """This step's forward: every live beam's last token, then prompt chunks within the token budget; and the
        searches that get logits from it, in the order of their rows."""
        config = self.engine.scheduler.config
        budget = config.max_num_batched_tokens - sum(len(s.beams) for s in active if s.prefilled)
        ids, starts, chunks, num_logits = [], [], [], []
        selecting: list[_Search] = []  # the searches that get logits this step, in the order of their rows
        for search in active:
            if search.prefilled:
                for beam in search.beams:
                    ids.append(beam.seq_id)
                    starts.append(len(beam.tokens) - 1)
                    chunks.append(beam.tokens[-1:])
                    num_logits.append(1)
                selecting.append(search)
                continue
            left = len(search.prompt) - search.start
            take = min(left, budget) if config.enable_chunked_prefill else (left if left <= budget else 0)
            if take <= 0:
                continue  # no budget left this step
            ids.append(search.beams[0].seq_id)
            starts.append(search.start)
            chunks.append(search.prompt[search.start : search.start + take])
            num_logits.append(1 if take == left else 0)  # logits once the whole prompt is in the cache
            search.start += take
            budget -= take
            if take == left:
                selecting.append(search)
        return ids, starts, chunks, num_logits, selecting

    def _select(self, search: _Search, logprobs: torch.Tensor) -> None:
        """Steps 1-3 of the module docstring for one prompt: sets ``search.beams`` to the next beams (tokens
        extended, blocks not yet moved), adds to ``search.finished`` and sets ``search.done``."""
        w, beams = self.params.beam_width, search.beams
        cum = torch.tensor([b.cum_logprob for b in beams], dtype=torch.float32, device=logprobs.device)
        vocab = logprobs.shape[-1]
        k = min(max(2, 1 + len(self.eos)) * w, len(beams) * vocab)
        top, index = torch.topk((cum[:, None] + logprobs).reshape(-1), k)
        out_len = len(beams[0].tokens) - len(search.prompt) + 1  # output tokens once this step's is added
        at_limit = out_len >= search.max_tokens
        next_beams: list[_Beam] = []
        for rank, (total, flat) in enumerate(zip(top.tolist(), index.tolist())):
            parent, token = beams[flat // vocab], flat % vocab
            ends = token in self.eos or at_limit
            if ends and rank >= w:
                continue  # only the top w may finish; the rest of the 2w are there to keep w beams alive
            if not ends and len(next_beams) == w:
                continue
            entry = ranked_logprobs(logprobs[flat // vocab : flat // vocab + 1], [token], 0)[0]
            entry[token].decoded_token = self._decode(token)
            child = _Beam(parent.seq_id, parent.tokens + [token], total, parent.logprobs + [entry])
            if ends:
                score = self._score(total, out_len)
                search.finished.append((score, child, "stop" if token in self.eos else "length"))
            else:
                next_beams.append(child)
        search.finished.sort(key=lambda f: f[0], reverse=True)  # stable: on a tie the earlier one stays first
        del search.finished[w:]
        search.beams = next_beams
        search.done = at_limit or not next_beams or not self._can_improve(search, out_len)

    def _score(self, cum_logprob: float, out_len: int) -> float:
        # in float32, as HF's beam scorer computes it, so that equal inputs rank equally
        return float(torch.tensor(cum_logprob, dtype=torch.float32) / (out_len ** self.params.length_penalty))

    def _can_improve(self, search: _Search, out_len: int) -> bool:
        """Whether a live beam could still enter the top ``w`` finished. Its cumulative log-probability can only
        fall, so its best possible score is that over the length that flatters it most: the longest allowed
        with a positive length penalty, the current one otherwise."""
        if len(search.finished) < self.params.beam_width:
            return True
        best_len = search.max_tokens if self.params.length_penalty > 0 else out_len
        return self._score(max(b.cum_logprob for b in search.beams), best_len) > search.finished[-1][0]

    def _place(self, search: _Search, parent_ids: set[str]) -> list[tuple[int, int]]:
        """Give the next beams their blocks. A parent with no surviving child is freed; its first surviving
        child keeps the parent's sequence, and each further child forks it (sharing every block). Then each
        beam makes the block its new token goes to its own (copy-on-write) and grows its table to hold it.
        Returns the block copies to make before the next forward."""
        for seq_id in parent_ids - {b.seq_id for b in search.beams}:
            self.blocks.free(seq_id)
            search.held.discard(seq_id)
        taken: set[str] = set()
        for beam in search.beams:
            if beam.seq_id in taken:
                child_id = self._new_id()
                self.blocks.fork(beam.seq_id, child_id)
                self.last_forks.append((child_id, beam.seq_id))
                search.held.add(child_id)
                beam.seq_id = child_id
                self.stats.forks += 1
            taken.add(beam.seq_id)
        copies = []
        forked = {child for child, _ in self.last_forks}
        # forks first: each copies the shared block while there is another holder, so the parent's first child,
        # processed last, finds the block its own and writes in place (which beam copies changes nothing else)
        for beam in sorted(search.beams, key=lambda b: b.seq_id not in forked):
            cached = len(beam.tokens) - 1  # the new token's position: the tokens before it are in the cache
            pair = self.blocks.copy_on_write(beam.seq_id, cached)
            if pair is not None:
                copies.append(pair)
                self.stats.kv_tokens_copied += cached % self.blocks.block_size
            self.blocks.append_slots(beam.seq_id, len(beam.tokens))
            self.stats.kv_tokens_reordered += cached  # HF's reorder_cache gathers all of it, shared or not
        return copies

    def _count_blocks(self, live: list[_Search]) -> None:
        tables = [self.blocks.block_table(b.seq_id) for s in live for b in s.beams]
        listed, distinct = sum(map(len, tables)), len({bid for t in tables for bid in t})
        st = self.stats
        st.block_steps_in_tables += listed
        st.block_steps_distinct += distinct
        st.peak_blocks = max(st.peak_blocks, distinct)
        st.peak_blocks_unshared = max(st.peak_blocks_unshared, listed)

    # --- output ------------------------------------------------------------------------------------------

    def _decode(self, token: int) -> str | None:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    def _output(self, search: _Search) -> BeamSearchOutput:
        seqs = []
        for score, beam, reason in search.finished:
            text = self.tokenizer.decode(beam.tokens, skip_special_tokens=True) if self.tokenizer is not None else None
            seqs.append(BeamSearchSequence(beam.tokens, beam.logprobs, beam.cum_logprob, score, text, reason,
                                           beam.tokens[-1] if reason == "stop" else None))
        return BeamSearchOutput(seqs)

"""Pictures of the engine at work: figures drawn from minifer's real state, recorded while it serves.

Nothing here is a sketch. Each picture runs the real engine on the loaded model (greedy sampling, so every count is
the same on every machine and every run) and draws what a recorder read from it:

* ``scheduler_timeline``: which request got how many tokens at each step: prompt chunks, decodes, admissions,
  preemptions, finishes (continuous batching, chapter 03);
* ``request_life``: one request's states, step by step, through a KV cache small enough to preempt it (chapter 03);
* ``block_table``: the KV cache's block tables after requests with a shared prefix, shared blocks and the free list
  read from the allocator (chapter 02);
* ``speculative_steps``: the drafts of a few speculative steps, which the target accepted, its correction or its
  bonus token (chapter 04).

The recorders ride on the engine's seams (``minifer.engine.components.Components``) and change none of its decisions:
``RecordingScheduler`` is the reference ``Scheduler`` noting each ``ScheduledBatch`` and what each step finished;
``RecordingVerifier`` is the reference verifier noting what it was shown and what it kept; the block table is read
from the ``KVCacheManager`` and its ``BlockPool`` between steps. Each function returns the figure and the recording
(a plain dataclass whose ``counts()`` a chapter can print beside it); ``record_*`` and ``draw_*`` are the two halves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from minifer.core.sched.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from minifer.request import Request
from minifer.sample.rejection_sampler import RejectionVerifier, rejection_sample, verify_greedy

if TYPE_CHECKING:  # imported lazily at run time: matplotlib is a course extra
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from minifer.engine.llm_engine import LLMEngine
    from minifer.entrypoints.llm import LLM

# One colour per meaning, the same in every picture.
COLORS = {"prefill": "#f5a54a", "decode": "#4c8fd6", "waiting": "#d9d9d9", "requeued": "#f3b6b6",
          "preempted": "#d62728", "finished": "#222222",
          "shared": "#f2c14e", "private": "#7fb3e6", "cached": "#b9e0b0", "free": "#ffffff",
          "accepted": "#8fd18f", "rejected": "#f19c99", "untested": "#eeeeee", "bonus": "#4c8fd6",
          "correction": "#f5a54a"}

# Stories of different lengths, arriving at different steps, asking for different lengths: continuous batching has
# slots to refill, a prompt longer than the step's token budget is cut into chunks, and the small cache runs out.
TIMELINE_PROMPTS = ("Once upon a time, there was a little girl named Lily.",
                    "Tom and his dog went to the park to play with a big red ball. "
                    "The sun was warm and the sky was blue.",
                    "The cat sat",
                    "One day, a bird",
                    "Mom baked a cake for the party and",
                    "The little boat")
TIMELINE_MAX_TOKENS = (28, 12, 34, 18, 14, 10)
TIMELINE_ARRIVALS = (0, 0, 0, 4, 8, 12)  # the engine step before which each request arrives


# --- building and driving an engine ---------------------------------------------------------------------


def fresh_engine(llm: "LLM", components: Any = None, **options: Any) -> "LLMEngine":
    """A new engine of its own (cache, queue, scheduler) on ``llm``'s loaded weights, with ``options`` as ``LLM``
    takes them: a picture needs a small cache or budget, and must not disturb the engine a chapter measures with."""
    from minifer import LLM

    args = llm.engine_args
    return LLM(args.model, share_weights_with=llm, dtype=llm.dtype, device=llm.device, load_format=args.load_format,
               quantization=args.quantization, enforce_eager=True, components=components, **options).engine


def greedy(max_tokens: int) -> Any:
    """Greedy sampling for exactly ``max_tokens`` tokens: the run's schedule depends on lengths alone."""
    from minifer import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def drive(engine: "LLMEngine", requests: Sequence[tuple[str, str, Any, int]],
          before_step: Callable[[int], None] | None = None) -> tuple[dict[str, list[int]], list[int]]:
    """Step ``engine`` until every request of ``requests`` (``(id, prompt, params, arrival step)``) is finished,
    adding each before the step it arrives at (at once when the engine would otherwise idle). Returns each
    request's output token ids and the tokens the engine gave its model at each step (``LLMEngine.step_tokens``)."""
    pending = sorted(requests, key=lambda r: r[3])
    outputs: dict[str, list[int]] = {}
    step_tokens: list[int] = []
    while pending or engine.has_unfinished_requests():
        while pending and (pending[0][3] <= len(step_tokens) or not engine.has_unfinished_requests()):
            rid, prompt, params, _ = pending.pop(0)
            engine.add_request(rid, prompt, params)
        if before_step is not None:
            before_step(len(step_tokens))
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        step_tokens.append(engine.step_tokens)
    return outputs, step_tokens


# --- recording the scheduler --------------------------------------------------------------------------


@dataclass(frozen=True)
class Scheduled:
    """One request's share of one step."""

    request_id: str
    num_tokens: int
    kind: str  # "prefill": prompt tokens (a chunk, or a preempted request's recomputation); "decode": its last token
    context: int = 0  # the request's tokens in all when scheduled: its prompt and what it has generated
    cached: int = 0  # admitted this step: prompt tokens the prefix cache already held (not computed)


@dataclass
class StepRecord:
    """What the scheduler decided at one engine step, and every request's state once the step ended."""

    step: int
    scheduled: list[Scheduled]
    admitted: list[str]
    preempted: list[str]
    finished: list[str] = field(default_factory=list)
    states: dict[str, str] = field(default_factory=dict)  # "waiting", "running", "preempted" (queued again), "finished"
    blocks_held: dict[str, int] = field(default_factory=dict)  # KV blocks in each request's table
    free_blocks: int = 0


def _kind(seq: Request, n: int, admitted: bool) -> str:
    """A step computes a decode when it brings exactly the sequence's last token, sampled at the step before."""
    decode = not admitted and n == 1 and seq.output_token_ids and seq.num_computed_tokens + 1 == seq.num_tokens
    return "decode" if decode else "prefill"


class RecordingScheduler(Scheduler):
    """The reference scheduler, unchanged, noting each step's ``ScheduledBatch`` and what the step finished:
    ``LLM(..., components=Components(scheduler=RecordingScheduler))``; read ``engine.scheduler.steps``."""

    def __init__(self, config: SchedulerConfig, blocks: Any) -> None:
        super().__init__(config, blocks)
        self.steps: list[StepRecord] = []
        self.arrivals: dict[str, int] = {}  # request id -> the step before which it was queued
        self.seqs: dict[str, Request] = {}

    def add(self, seq: Request) -> None:
        super().add(seq)
        self.arrivals.setdefault(seq.request_id, len(self.steps))
        self.seqs[seq.request_id] = seq

    def schedule(self) -> ScheduledBatch:
        was_running = {id(s) for s in self.running}
        batch = super().schedule()
        admitted = [id(s) not in was_running for s in batch.seqs]
        scheduled = [Scheduled(s.request_id, n, _kind(s, n, new), s.num_tokens, s.num_computed_tokens if new else 0)
                     for s, n, new in zip(batch.seqs, batch.num_new_tokens, admitted)]
        self.steps.append(StepRecord(len(self.steps), scheduled, [s.request_id for s, new in zip(batch.seqs, admitted)
                                                                   if new], [s.request_id for s in batch.preempted]))
        return batch

    def update_from_output(self, batch: ScheduledBatch, sampled: list[Request], result: Any,
                           tokenizer: Any = None) -> list[Request]:
        out = super().update_from_output(batch, sampled, result, tokenizer)
        record, running = self.steps[-1], {id(s) for s in self.running}
        record.finished = [s.request_id for s in sampled if s.is_finished]
        for rid, seq in self.seqs.items():
            record.states[rid] = ("finished" if seq.is_finished else "running" if id(seq) in running
                                  else "preempted" if seq.num_preemptions else "waiting")
            record.blocks_held[rid] = len(self.blocks.block_table(rid)) if self.blocks.has_seq(rid) else 0
        record.free_blocks = self.blocks.num_free_blocks
        return out


@dataclass
class SchedulerRun:
    """A recorded run: the steps, when each request arrived, its prompt's length and its output."""

    steps: list[StepRecord]
    arrivals: dict[str, int]
    prompt_tokens: dict[str, int]
    outputs: dict[str, list[int]]
    step_tokens: list[int]  # the engine's own count of the tokens each step computed
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    engine_stats: dict[str, Any] = field(default_factory=dict)  # ``LLMEngine.stats()`` once the run ended

    @property
    def requests(self) -> list[str]:
        return list(self.arrivals)

    def cells(self, kind: str | None = None) -> list[tuple[int, Scheduled]]:
        """Every (step, share) of the run, or only the ``kind`` ones."""
        return [(r.step, s) for r in self.steps for s in r.scheduled if kind is None or s.kind == kind]

    def counts(self) -> dict[str, int]:
        """The run in numbers, for a chapter to print beside the picture."""
        return {"steps": len(self.steps), "requests": len(self.arrivals),
                "prefill_tokens": sum(s.num_tokens for _, s in self.cells("prefill")),
                "decode_tokens": sum(s.num_tokens for _, s in self.cells("decode")),
                "prefill_cells": len(self.cells("prefill")), "decode_cells": len(self.cells("decode")),
                "admissions": sum(len(r.admitted) for r in self.steps),
                "preemptions": sum(len(r.preempted) for r in self.steps),
                "finished": sum(len(r.finished) for r in self.steps),
                "most_running": max(len(r.scheduled) for r in self.steps)}

    def life(self, request_id: str) -> list[tuple[int, str]]:
        """The request's events, ``(step, what)``: arrived, admitted, preempted, finished."""
        events = [(self.arrivals[request_id], "arrived")]
        for r in self.steps:
            events += [(r.step, what) for what, ids in (("admitted", r.admitted), ("preempted", r.preempted),
                                                         ("finished", r.finished)) if request_id in ids]
        return events


def record_run(llm: "LLM", prompts: Sequence[str] = TIMELINE_PROMPTS,
               max_tokens: Sequence[int] = TIMELINE_MAX_TOKENS, arrivals: Sequence[int] = TIMELINE_ARRIVALS, *,
               max_num_seqs: int = 4, max_num_batched_tokens: int = 16, num_kv_blocks: int = 12,
               block_size: int = 8) -> SchedulerRun:
    """Serve ``prompts`` (greedy, ``max_tokens`` each, arriving before the given steps) on a fresh engine over
    ``llm``'s weights whose scheduler records every step. The defaults give a small token budget (16: long prompts
    are prefilled in chunks) and a small cache (12 blocks of 8 tokens: running requests outgrow it and one is
    preempted)."""
    from minifer.engine.components import Components

    engine = fresh_engine(llm, Components(scheduler=RecordingScheduler), max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, num_kv_blocks=num_kv_blocks,
                          block_size=block_size)
    requests = [(f"r{i}", p, greedy(m), a) for i, (p, m, a) in enumerate(zip(prompts, max_tokens, arrivals))]
    outputs, step_tokens = drive(engine, requests)
    sched = engine.scheduler
    return SchedulerRun(sched.steps, dict(sched.arrivals),
                        {rid: len(seq.prompt_token_ids) for rid, seq in sched.seqs.items()}, outputs, step_tokens,
                        engine.kv_cache_manager.num_blocks, block_size, max_num_seqs, max_num_batched_tokens,
                        engine.stats())


# --- drawing the timeline -----------------------------------------------------------------------------


def _cell(ax: "Axes", x: float, y: float, w: float, h: float, color: str, gid: str, **kw: Any) -> None:
    from matplotlib.patches import Rectangle

    rect = Rectangle((x, y), w, h, facecolor=color, edgecolor=kw.pop("edgecolor", "white"), linewidth=kw.pop("lw", 0.6),
                     **kw)
    rect.set_gid(gid)
    ax.add_patch(rect)


def _draw_budget(ax: "Axes", run: SchedulerRun) -> None:
    """Top panel: the tokens each step computed, prompt tokens stacked on decodes, under the step's budget."""
    steps = range(len(run.steps))
    decode = [sum(s.num_tokens for s in r.scheduled if s.kind == "decode") for r in run.steps]
    prefill = [sum(s.num_tokens for s in r.scheduled if s.kind == "prefill") for r in run.steps]
    ax.bar(steps, decode, width=0.9, color=COLORS["decode"])
    ax.bar(steps, prefill, width=0.9, bottom=decode, color=COLORS["prefill"])
    ax.axhline(run.max_num_batched_tokens, color="#555555", ls="--", lw=1)
    budget = run.max_num_batched_tokens
    ax.text(-0.5, budget * 1.04, f"step budget: max_num_batched_tokens={budget}", va="bottom", ha="left",
            fontsize=8, color="#555555")
    ax.set_ylabel("tokens\nin the step")
    ax.set_ylim(0, run.max_num_batched_tokens * 1.35)
    ax.spines[["top", "right"]].set_visible(False)


def _draw_rows(ax: "Axes", run: SchedulerRun) -> None:
    """One row per request: waiting steps thin and grey, prompt chunks orange (their token count written in),
    decodes blue, a red cross where it was preempted, a black dot where it finished."""
    rows = {rid: i for i, rid in enumerate(run.requests)}
    done: set[str] = set()
    requeued: set[str] = set()  # preempted, not yet admitted again
    for r in run.steps:
        requeued.update(r.preempted)
        requeued.difference_update(r.admitted)
        shares = {s.request_id: s for s in r.scheduled}
        for rid, y in rows.items():
            if rid in shares:
                s = shares[rid]
                _cell(ax, r.step - 0.5, y - 0.4, 1, 0.8, COLORS[s.kind], s.kind)
                if s.kind == "prefill":
                    ax.text(r.step, y, str(s.num_tokens), ha="center", va="center", fontsize=7)
            elif run.arrivals[rid] <= r.step and rid not in done:
                again = rid in requeued
                _cell(ax, r.step - 0.5, y - 0.12, 1, 0.24, COLORS["requeued" if again else "waiting"], "waiting", lw=0)
            if rid in r.preempted:
                ax.plot(r.step, y, marker="X", ms=11, color=COLORS["preempted"], mec="white", gid="preempted")
            if rid in r.finished:
                ax.plot(r.step + 0.5, y, marker="o", ms=6, color=COLORS["finished"], gid="finished")
        done.update(r.finished)
    labels = [f"{rid} ({run.prompt_tokens[rid]}+{len(run.outputs.get(rid, []))} tok)" for rid in rows]
    ax.set_yticks(range(len(rows)), labels, fontsize=9)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel("engine step")
    ax.spines[["top", "right"]].set_visible(False)


def _timeline_legend(fig: "Figure") -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(color=COLORS["prefill"], label="prompt tokens (chunk; number = tokens)"),
               Patch(color=COLORS["decode"], label="decode (1 token)"), Patch(color=COLORS["waiting"], label="waiting"),
               Patch(color=COLORS["requeued"], label="waiting again (to recompute)"),
               Line2D([], [], marker="X", ls="", ms=9, color=COLORS["preempted"], label="preempted"),
               Line2D([], [], marker="o", ls="", ms=6, color=COLORS["finished"], label="finished")]
    fig.legend(handles=handles, loc="lower center", ncol=6, fontsize=8, frameon=False)


def draw_timeline(run: SchedulerRun) -> "Figure":
    """Requests as rows, engine steps as columns: what the scheduler gave each request at each step, and above it
    how full each step was. Continuous batching shows as a finished row's slot going to a waiting one at the very
    next step; chunked prefill as a long prompt spread over several steps beside other requests' decodes."""
    import matplotlib.pyplot as plt

    fig, (top, ax) = plt.subplots(2, 1, sharex=True, figsize=(10, 1.9 + 0.42 * len(run.requests)),
                                  gridspec_kw={"height_ratios": [1.1, max(2, 0.42 * len(run.requests))]})
    _draw_budget(top, run)
    _draw_rows(ax, run)
    ax.set_xlim(-0.7, len(run.steps) - 0.3)
    c = run.counts()
    top.set_title(f"the scheduler, step by step: {c['requests']} requests, {c['steps']} steps, at most "
                  f"{run.max_num_seqs} running, {run.num_blocks} KV blocks of {run.block_size} tokens "
                  f"({c['preemptions']} preemption{'s' * (c['preemptions'] != 1)})", fontsize=10)
    _timeline_legend(fig)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def scheduler_timeline(llm: "LLM", **kwargs: Any) -> tuple["Figure", SchedulerRun]:
    """``record_run(llm, **kwargs)`` drawn by ``draw_timeline``."""
    run = record_run(llm, **kwargs)
    return draw_timeline(run), run


# --- one request's life -------------------------------------------------------------------------------

LANES = ("waiting", "prefill", "decode", "preempted", "finished")
LANE_LABELS = ("WAITING", "RUNNING:\nprompt", "RUNNING:\ndecode", "PREEMPTED\n(queued again)", "FINISHED")


def life_lanes(run: SchedulerRun, request_id: str) -> list[tuple[int, str]]:
    """``(step, lane)`` for every step of the request's life, from its arrival to the step it finished: the lane is
    what it did in that step (prompt tokens, a decode) or, when it got nothing, the state it was left in."""
    lanes: list[tuple[int, str]] = []
    state = "waiting"
    for r in run.steps[run.arrivals[request_id]:]:
        share = next((s for s in r.scheduled if s.request_id == request_id), None)
        if request_id in r.preempted:
            state = "preempted"
        lanes.append((r.step, share.kind if share else state))
        if request_id in r.finished:
            lanes.append((r.step + 1, "finished"))
            break
        state = r.states.get(request_id, state)
        state = "decode" if state == "running" else state
    return lanes


def preempted_request(run: SchedulerRun) -> str:
    """The request whose life shows the most: preempted, and with the most distinct steps at which something
    happened to it (a wait before its first admission counts), the first such; else the first request."""
    preempted = [rid for r in run.steps for rid in r.preempted]
    if not preempted:
        return run.requests[0]
    return max(dict.fromkeys(preempted), key=lambda rid: len({step for step, _ in run.life(rid)}))


def _annotate_life(ax: "Axes", run: SchedulerRun, request_id: str) -> None:
    """Each event of the request written at its step, beside the lane it moved to."""
    lane = {"arrived": 0, "admitted": 1, "preempted": 3, "finished": 4}
    for step, what in run.life(request_id):
        text = f"{what} at step {step}"
        if what == "admitted":
            share = next(s for s in run.steps[step].scheduled if s.request_id == request_id)
            context, prompt = share.context, run.prompt_tokens[request_id]
            if context == prompt:
                chunked = share.num_tokens + share.cached < context
                text += f"\nits {prompt}-token prompt" + (" in chunks" if chunked else "")
            else:
                text += f" again: recomputes\n{prompt} prompt + {context - prompt} generated tokens"
            text += f"\n({share.cached} found in the prefix cache)" if share.cached else ""
        elif what == "finished":
            text = f"finished at the end\nof step {step}"
        x = step + (1 if what == "finished" else 0)
        ax.annotate(text, (x, lane[what]), xytext=(-4 if what == "finished" else 7, 9), ha="right" if what ==
                    "finished" else "left", textcoords="offset points", fontsize=8, color="#333333")


def draw_request_life(run: SchedulerRun, request_id: str | None = None) -> "Figure":
    """One request's life as a path through its states, and under it the KV blocks it held and the blocks left
    free in the whole cache. A preemption shows as the path jumping to PREEMPTED while its blocks drop to 0:
    recomputation frees everything, and the request later computes its prompt and its tokens so far again."""
    import matplotlib.pyplot as plt

    rid = request_id or preempted_request(run)
    lanes = life_lanes(run, rid)
    fig, (ax, low) = plt.subplots(2, 1, sharex=True, figsize=(10, 5.2), gridspec_kw={"height_ratios": [2.2, 1]})
    xs, ys = [s for s, _ in lanes], [LANES.index(lane) for _, lane in lanes]
    ax.step(xs, ys, where="mid", color="#999999", lw=1, zorder=1)
    for lane in LANES:
        pts = [(s, LANES.index(ln)) for s, ln in lanes if ln == lane]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=46, color=COLORS[lane], edgecolor="#333333",
                   linewidth=0.5, zorder=2, gid=f"life:{lane}")
    _annotate_life(ax, run, rid)
    ax.set_yticks(range(len(LANES)), LANE_LABELS, fontsize=8)
    ax.set_ylim(len(LANES) - 0.4, -0.6)
    ax.set_title(f"the life of request {rid} ({run.prompt_tokens[rid]}-token prompt, {len(run.outputs[rid])} tokens "
                 f"out) in a cache of {run.num_blocks} blocks of {run.block_size} tokens", fontsize=10)
    steps = [r.step for r in run.steps if xs[0] <= r.step <= xs[-1]]
    low.bar(steps, [run.steps[s].blocks_held.get(rid, 0) for s in steps], width=0.8, color=COLORS["private"],
            label=f"blocks {rid} holds")
    low.plot(steps, [run.steps[s].free_blocks for s in steps], color="#444444", lw=1.2,
             label="free blocks (whole cache)")
    low.set(ylabel="KV blocks\n(after the step)", xlabel="engine step", ylim=(0, run.num_blocks + 1))
    low.legend(fontsize=8, loc="upper left", ncol=2, frameon=False, bbox_to_anchor=(0, 1.12))
    for a in (ax, low):
        a.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig


def request_life(llm: "LLM", request_id: str | None = None, **kwargs: Any) -> tuple["Figure", SchedulerRun]:
    """``record_run(llm, **kwargs)``, one request's life drawn (the preempted one unless ``request_id``)."""
    run = record_run(llm, **kwargs)
    return draw_request_life(run, request_id), run


# --- the block table ------------------------------------------------------------------------------------

SHARED_PREFIX = "Once upon a time, in a small village at the edge of a big forest, there lived a kind old man"
SUFFIXES = (" who loved to grow flowers.", " who had a very old dog.", " named Ben.")
OTHER_PROMPT = "Tom and his dog went to the park to play with a big red ball."


@dataclass
class BlockSnapshot:
    """The KV cache's bookkeeping between two steps, read from the allocator: each request's block table (logical
    block ``i`` of the request lives in physical block ``tables[rid][i]``), how many tokens it holds, and every
    block's reference count and whether the prefix cache indexes it."""

    step: int
    block_size: int
    tables: dict[str, list[int]]
    num_tokens: dict[str, int]  # tokens whose keys and values the request's table holds
    ref_counts: list[int]  # per physical block: how many tables hold it
    cached: list[bool]  # per physical block: indexed by the prefix cache (a hash of its tokens and all before them)
    prompts: dict[str, str] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return len(self.ref_counts)

    @property
    def shared(self) -> list[int]:
        """Blocks in more than one table: a prefix computed once and read by every request that starts with it."""
        return [b for b, n in enumerate(self.ref_counts) if n > 1]

    def state(self, block: int) -> str:
        """``shared``, ``private`` (one table), ``cached`` (in no table, but its prefix is kept until the block is
        needed: the next request with that prefix takes it back) or ``free``."""
        n = self.ref_counts[block]
        return "shared" if n > 1 else "private" if n == 1 else "cached" if self.cached[block] else "free"

    def counts(self) -> dict[str, int]:
        states = [self.state(b) for b in range(self.num_blocks)]
        return {"blocks": self.num_blocks, "in_tables": sum(len(t) for t in self.tables.values()),
                **{s: states.count(s) for s in ("shared", "private", "cached", "free")}}


def snapshot_blocks(engine: "LLMEngine", step: int = 0, prompts: dict[str, str] | None = None) -> BlockSnapshot:
    """The block tables of ``engine``'s running requests and its pool's reference counts, as they are now (minifer's
    ``KVCacheManager``: the counts are its ``BlockPool``'s own, not recounted from the tables)."""
    manager = engine.kv_cache_manager
    running = engine.scheduler.running
    return BlockSnapshot(step, manager.block_size,
                         {s.request_id: list(manager.block_table(s.request_id)) for s in running},
                         {s.request_id: s.num_computed_tokens for s in running},
                         [b.ref_count for b in manager.block_pool.blocks],
                         [b.block_hash is not None for b in manager.block_pool.blocks], dict(prompts or {}))


def shared_prefix_engine(llm: "LLM", prefix: str = SHARED_PREFIX, suffixes: Sequence[str] = SUFFIXES,
                         other: str = OTHER_PROMPT, decode_steps: int = 3, *, block_size: int = 8,
                         num_kv_blocks: int = 24, after_step: Callable[["LLMEngine", int], None] | None = None
                         ) -> tuple["LLMEngine", dict[str, str]]:
    """A fresh engine (prefix caching on) stopped mid-run: at step 0 ``other`` (asking for 2 tokens: it finishes
    early and leaves its blocks behind) and the first ``prefix + suffix`` arrive; at step 1, once the first has
    computed (and so published) the prefix's blocks, the other suffixes arrive and find them in the cache; then
    ``decode_steps`` more steps. ``after_step(engine, step)`` is called after each. Returns the engine and the
    prompts by request id."""
    engine = fresh_engine(llm, block_size=block_size, num_kv_blocks=num_kv_blocks, enable_prefix_caching=True)
    prompts = {f"s{i}": prefix + s for i, s in enumerate(suffixes)}
    engine.add_request("other", other, greedy(2))
    engine.add_request("s0", prompts["s0"], greedy(32))
    for step in range(decode_steps + 2):
        if step == 1:
            for rid in list(prompts)[1:]:
                engine.add_request(rid, prompts[rid], greedy(32))
        engine.step()
        if after_step is not None:
            after_step(engine, step)
    return engine, {"other": other, **prompts}


def record_block_tables(llm: "LLM", **kwargs: Any) -> list[BlockSnapshot]:
    """``shared_prefix_engine(llm, **kwargs)``'s cache read after every step (for a slider over the steps: draw
    ``snapshots[step]``); the last one is ``record_block_table``'s."""
    snapshots: list[BlockSnapshot] = []
    prompts = {f"s{i}": kwargs.get("prefix", SHARED_PREFIX) + s for i, s in enumerate(kwargs.get("suffixes", SUFFIXES))}
    prompts["other"] = kwargs.get("other", OTHER_PROMPT)
    shared_prefix_engine(llm, after_step=lambda engine, step: snapshots.append(snapshot_blocks(engine, step, prompts)),
                         **kwargs)
    return snapshots


def record_block_table(llm: "LLM", **kwargs: Any) -> BlockSnapshot:
    """``shared_prefix_engine(llm, **kwargs)``'s cache, read after its last step."""
    return record_block_tables(llm, **kwargs)[-1]


def _draw_tables(ax: "Axes", snap: BlockSnapshot, per_row: int = 16) -> None:
    """One row per request: its logical blocks left to right, each labelled with the physical block it lives in;
    the unfilled part of a last block left pale."""
    for y, (rid, table) in enumerate(snap.tables.items()):
        for i, block in enumerate(table):
            kind = "shared" if snap.ref_counts[block] > 1 else "private"
            _cell(ax, i, y, 0.94, 0.8, COLORS[kind], f"table:{kind}", edgecolor="#555555")
            fill = min(snap.block_size, snap.num_tokens[rid] - i * snap.block_size) / snap.block_size
            if fill < 1:
                _cell(ax, i + 0.94 * max(fill, 0), y, 0.94 * (1 - max(fill, 0)), 0.8, "white", "unfilled", lw=0,
                      alpha=0.7)
            ax.text(i + 0.47, y + 0.4, str(block), ha="center", va="center", fontsize=10, fontweight="bold")
        prompt = snap.prompts.get(rid, "")
        ax.text(len(table) + 0.15, y + 0.4, f"{snap.num_tokens[rid]} tokens of KV: “…{prompt[-26:]}” + generated",
                va="center", fontsize=8, color="#444444")
    width = max((len(t) for t in snap.tables.values()), default=0)
    first = next(iter(snap.tables.values()), [])
    common = next((i for i, b in enumerate(first) if snap.ref_counts[b] < 2), len(first))
    if common:
        ax.annotate(f"{common * snap.block_size} prompt tokens in common: computed once, read by {len(snap.tables)}",
                    (0, -0.05), ha="left", va="bottom", fontsize=8, color="#7a5b00")
    ax.set_yticks([y + 0.4 for y in range(len(snap.tables))], list(snap.tables), fontsize=9)
    ax.set_xticks([i + 0.47 for i in range(width)], [f"logical\n{i}" for i in range(width)], fontsize=7)
    ax.set(xlim=(-0.1, max(per_row, width + 7) + 0.1), ylim=(max(len(snap.tables), 1), -0.45))
    ax.set_title("block tables: logical block → physical block (the number)", fontsize=9, loc="left")
    ax.tick_params(length=0)
    ax.spines[:].set_visible(False)


def _draw_pool(ax: "Axes", snap: BlockSnapshot, per_row: int = 16) -> None:
    """Every physical block of the cache, in rows of ``per_row``, coloured by its state; a shared one with the
    number of tables that hold it."""
    for b in range(snap.num_blocks):
        x, y, state = b % per_row, b // per_row, snap.state(b)
        _cell(ax, x, y, 0.94, 0.8, COLORS[state], f"pool:{state}", edgecolor="#555555")
        label = f"{b}" + (f"\n×{snap.ref_counts[b]}" if state == "shared" else "")
        ax.text(x + 0.47, y + 0.4, label, ha="center", va="center", fontsize=8)
    rows = -(-snap.num_blocks // per_row)
    ax.set(xlim=(-0.1, per_row + 0.1), ylim=(rows, -0.2), xticks=[], yticks=[])
    ax.set_title(f"the pool: all {snap.num_blocks} physical blocks", fontsize=9, loc="left")
    ax.spines[:].set_visible(False)


def draw_block_table(snap: BlockSnapshot) -> "Figure":
    """The block tables of the running requests over the pool they draw from. Shared blocks (gold) are one
    computation read by several requests: the prefix cache found them, by the hash of their tokens, when the later
    requests arrived. A block holds ``block_size`` tokens, so only a request's last block is ever partly empty."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = -(-snap.num_blocks // 16)
    fig, (top, low) = plt.subplots(2, 1, figsize=(10, 1.6 + 0.5 * len(snap.tables) + 0.5 * rows),
                                   gridspec_kw={"height_ratios": [max(len(snap.tables), 1), rows]})
    _draw_tables(top, snap)
    _draw_pool(low, snap)
    c = snap.counts()
    fig.suptitle(f"the KV cache after step {snap.step}: {c['shared']} blocks shared, {c['private']} private, "
                 f"{c['cached']} cached but free, {c['free']} free ({snap.block_size} tokens per block)", fontsize=10)
    labels = {"shared": "shared (ref count > 1)", "private": "in one table", "cached": "free, prefix kept (evictable)",
              "free": "free"}
    fig.legend(handles=[Patch(facecolor=COLORS[k], edgecolor="#555555", label=v) for k, v in labels.items()],
               loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def block_table(llm: "LLM", **kwargs: Any) -> tuple["Figure", BlockSnapshot]:
    """``record_block_table(llm, **kwargs)`` drawn by ``draw_block_table``."""
    snap = record_block_table(llm, **kwargs)
    return draw_block_table(snap), snap


# --- the speculative step -------------------------------------------------------------------------------

SPEC_PROMPT = "Tom and his dog went to the park to play with a big red ball."  # some steps accept all, some do not


class RecordingVerifier(RejectionVerifier):
    """The reference verifier, unchanged, noting every verification: the drafts it was shown, the target's greedy
    token after each prefix of them (greedy rows), and the tokens it kept. ``step`` is set by whoever steps the
    engine, so that each record carries its engine step."""

    def __init__(self) -> None:
        self.step = 0
        self.log: list[tuple[int, list[int], list[int], list[int]]] = []  # (step, drafts, target's tokens, emitted)

    def greedy(self, draft_tokens: list[list[int]], target_argmax: torch.Tensor) -> list[list[int]]:
        out = verify_greedy(draft_tokens, target_argmax)
        rows = target_argmax.tolist()
        self.log += [(self.step, list(d), rows[i][: len(o)], list(o))
                     for i, (d, o) in enumerate(zip(draft_tokens, out))]
        return out

    def sample(self, draft_tokens: list[list[int]], draft_probs: torch.Tensor, target_probs: torch.Tensor,
               generators: list[torch.Generator | None]) -> list[list[int]]:
        out = rejection_sample(draft_tokens, draft_probs, target_probs, generators)
        self.log += [(self.step, list(d), [], list(o)) for d, o in zip(draft_tokens, out)]
        return out


@dataclass(frozen=True)
class SpecStep:
    """One sequence's verification at one engine step: ``proposed`` drafts, of which the first ``accepted`` were
    kept, then one token of the target's own: its correction at the first rejected draft, or the bonus token after
    all of them. ``emitted`` is what the step appended (``accepted + 1`` tokens)."""

    step: int
    proposed: list[int]
    emitted: list[int]
    proposed_text: list[str]
    emitted_text: list[str]

    @property
    def accepted(self) -> int:
        return len(self.emitted) - 1

    @property
    def bonus(self) -> bool:
        """All drafts accepted: the last token is the bonus the target's extra position gave for free."""
        return self.accepted == len(self.proposed)


@dataclass
class SpecRun:
    """A recorded run of speculative decoding: the prompt, its output, every verification, the engine's counters."""

    method: str
    k: int
    prompt: str
    output_token_ids: list[int]
    steps: list[SpecStep]
    engine_stats: dict[str, Any]

    def counts(self) -> dict[str, Any]:
        proposed, accepted = sum(len(s.proposed) for s in self.steps), sum(s.accepted for s in self.steps)
        return {"verify_steps": len(self.steps), "proposed": proposed, "accepted": accepted,
                "rejected_steps": sum(not s.bonus for s in self.steps), "bonus_steps": sum(s.bonus for s in self.steps),
                "emitted": sum(len(s.emitted) for s in self.steps),
                "tokens_per_verify": round(sum(len(s.emitted) for s in self.steps) / max(len(self.steps), 1), 2)}


def _token_text(tokenizer: Any, token: int) -> str:
    """A token as the learner should read it: its text with a space shown as ␣ and a newline as ⏎."""
    return tokenizer.decode([token]).replace(" ", "␣").replace("\n", "⏎")


def record_speculation(llm: "LLM", prompt: str = SPEC_PROMPT, *, draft: Any = "tinystories-draft",
                       method: str = "draft_model", k: int = 4, max_tokens: int = 24) -> SpecRun:
    """Generate ``max_tokens`` greedy tokens for ``prompt`` on a fresh speculating engine over ``llm``'s weights
    (``method`` ``"draft_model"`` with ``draft``: a model name, the ``LLM`` of the draft model, or a loaded draft
    module such as a speculating ``LLM``'s ``draft_model``; or ``"ngram"``), its verifier
    recording every step."""
    from minifer.engine.components import Components

    config: dict[str, Any] = {"method": method, "num_speculative_tokens": k}
    if method == "draft_model":
        from minifer import LLM

        config["model"] = draft.model if isinstance(draft, LLM) else draft  # a loaded draft's weights, or a name
    verifier = RecordingVerifier()
    engine = fresh_engine(llm, Components(verifier=verifier), speculative_config=config, num_kv_blocks=32,
                          block_size=16)

    def at(step: int) -> None:
        verifier.step = step

    outputs, _ = drive(engine, [("spec", prompt, greedy(max_tokens), 0)], before_step=at)
    text = lambda ids: [_token_text(engine.tokenizer, t) for t in ids]  # noqa: E731
    steps = [SpecStep(step, d, o, text(d), text(o)) for step, d, _, o in verifier.log if d]
    return SpecRun(method, k, prompt, outputs["spec"], steps, engine.speculator.summary())


def _draw_spec_step(ax: "Axes", s: SpecStep, y: float, k: int) -> None:
    """Two rows for one step: the drafts (kept green, the first rejected red, the ones after it never tested, grey)
    and what the step emitted under them (the kept drafts, then the target's own token: blue bonus or orange
    correction)."""
    for j, word in enumerate(s.proposed_text):
        kind = "accepted" if j < s.accepted else "rejected" if j == s.accepted else "untested"
        _cell(ax, j, y, 0.96, 0.9, COLORS[kind], f"spec:{kind}", edgecolor="#777777")
        ax.text(j + 0.48, y + 0.45, word, ha="center", va="center", fontsize=9,
                color="#999999" if kind == "untested" else "black")
    for j, word in enumerate(s.emitted_text):
        kind = "accepted" if j < s.accepted else "bonus" if s.bonus else "correction"
        _cell(ax, j, y + 1, 0.96, 0.9, COLORS[kind], f"emit:{kind}", edgecolor="#777777")
        ax.text(j + 0.48, y + 1.45, word, ha="center", va="center", fontsize=9,
                color="white" if kind == "bonus" else "black")
    verdict = "all accepted: bonus token" if s.bonus else f"draft {s.accepted + 1} rejected: target's correction"
    tokens = f"{len(s.emitted)} token{'s' * (len(s.emitted) > 1)}"
    ax.text(k + 1.1, y + 0.95, f"{s.accepted} of {len(s.proposed)} kept → {tokens}\n{verdict}",
            va="center", fontsize=8, color="#333333")


def draw_speculation(run: SpecRun, steps: int = 6) -> "Figure":
    """The first ``steps`` verifications, one pair of rows each: what the draft proposed and what the target's one
    forward pass let through. Every step emits at least one token (the target's own), at most ``k + 1``."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    shown = run.steps[:steps]
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.82 * len(shown)))
    for i, s in enumerate(shown):
        _draw_spec_step(ax, s, 2.5 * i, run.k)
    ticks = [(2.5 * i + 0.45, f"step {s.step}: drafts") for i, s in enumerate(shown)]
    ticks += [(2.5 * i + 1.45, "emitted") for i in range(len(shown))]
    ax.set_yticks([t for t, _ in ticks], [label for _, label in ticks], fontsize=8)
    ax.set_xticks([j + 0.48 for j in range(run.k + 1)], [f"draft {j + 1}" for j in range(run.k)] + ["bonus"],
                  fontsize=8)
    ax.xaxis.tick_top()
    ax.set(xlim=(-0.05, run.k + 3.2), ylim=(2.5 * len(shown) - 0.5, -0.1))
    ax.tick_params(length=0)
    ax.spines[:].set_visible(False)
    c = run.counts()
    more = f" (the first {len(shown)} of {len(run.steps)} steps shown)" if len(shown) < len(run.steps) else ""
    ax.set_title(f"speculative decoding ({run.method}, k={run.k}){more}: {c['accepted']} of {c['proposed']} drafts "
                 f"kept, {c['tokens_per_verify']} tokens per target forward\nafter the prompt “{run.prompt}”",
                 fontsize=10, pad=22)
    labels = {"accepted": "accepted draft", "rejected": "first rejected draft", "untested": "not tested",
              "correction": "target's correction", "bonus": "bonus token"}
    fig.legend(handles=[Patch(facecolor=COLORS[kk], edgecolor="#777777", label=v) for kk, v in labels.items()],
               loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def speculative_steps(llm: "LLM", steps: int = 6, **kwargs: Any) -> tuple["Figure", SpecRun]:
    """``record_speculation(llm, **kwargs)``, its first ``steps`` verifications drawn by ``draw_speculation``."""
    run = record_speculation(llm, **kwargs)
    return draw_speculation(run, steps), run


def save_all(llm: "LLM", folder: str) -> list[str]:
    """Every picture of this module for ``llm``, as PNG files in ``folder`` (the static copies a chapter stores for
    readers without a kernel). Returns their paths."""
    from pathlib import Path

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    run = record_run(llm)
    figures = {"scheduler_timeline": draw_timeline(run), "request_life": draw_request_life(run),
               "block_table": block_table(llm)[0], "speculative_step": speculative_steps(llm)[0]}
    paths = []
    for name, fig in figures.items():
        fig.savefig(out / f"{name}.png", dpi=110)
        paths.append(str(out / f"{name}.png"))
    return paths


if __name__ == "__main__":  # python -m minifer_course.pictures /tmp/pictures
    import sys

    import matplotlib

    matplotlib.use("Agg")
    from minifer import LLM

    print("\n".join(save_all(LLM("tinystories-target"), sys.argv[1] if len(sys.argv) > 1 else "pictures")))

"""Graders of exercise 03 (continuous batching): one scheduler step, preemption by recompute, and what the scheduler
does after the forward pass (``update_from_output``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from minifer_course.grading.base import Check, run_checks
from minifer_course.workbench import StepRequest

__all__ = ["check_schedule_step", "check_preempt", "check_preemptions_in_engine", "check_update_from_output",
           "SCHEDULER_SCENARIOS"]


# --- one continuous-batching step -----------------------------------------------------------


def _schedule_with_minifer(running: list[StepRequest], waiting: list[StepRequest], free_blocks: int,
                           block_size: int, max_num_seqs: int, token_budget: int
                           ) -> tuple[list[tuple[str, int]], list[str]]:
    """The same state built in minifer's Scheduler (prefix caching off, chunked prefill on): its answer."""
    from minifer.core.kv_cache_manager import KVCacheManager
    from minifer.core.sched.scheduler import Scheduler, SchedulerConfig
    from minifer.request import Request as EngineSequence
    from minifer.request import RequestStatus
    from minifer.sampling_params import SamplingParams

    total = free_blocks + sum(r.num_blocks for r in running)
    blocks = KVCacheManager(max(total, 1), block_size, enable_prefix_caching=False)
    if total == 0:  # KVCacheManager needs at least one block: hold it in a sequence nobody schedules
        blocks.allocate("__pad__", [0])
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=token_budget,
                                      enable_chunked_prefill=True), blocks)

    def seq(r: StepRequest) -> EngineSequence:
        return EngineSequence(request_id=r.name, prompt=None, prompt_token_ids=list(range(r.num_tokens)),
                              params=SamplingParams(), max_tokens=1, eos_token_ids=frozenset())

    for r in running:
        s = seq(r)
        blocks.allocate(r.name, list(range(r.num_blocks * block_size)))
        s.num_computed_tokens, s.status = r.num_computed, RequestStatus.RUNNING
        sched.running.append(s)
    for r in waiting:
        sched.waiting.append(seq(r))
    assert blocks.num_free_blocks == free_blocks
    batch = sched.schedule()
    return ([(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)],
            [s.request_id for s in batch.preempted])


def _r(name: str, num_tokens: int, num_computed: int = 0, num_blocks: int = 0) -> StepRequest:
    return StepRequest(name, num_tokens, num_computed, num_blocks)


# (label, kwargs of schedule_step, expected (scheduled, preempted), hint). tests/course/test_exercises.py checks every
# expected answer against minifer's Scheduler on the same state.
SCHEDULER_SCENARIOS: list[tuple[str, dict[str, Any], tuple[list[tuple[str, int]], list[str]], str]] = [
    ("decodes: each running request gets 1 token, oldest first",
     dict(running=[_r("a", 9, 8, 2), _r("b", 14, 13, 4), _r("c", 5, 4, 1)], waiting=[], free_blocks=2,
          block_size=4, max_num_seqs=8, token_budget=64),
     ([("a", 1), ("b", 1), ("c", 1)], []),
     "a running request gets num_tokens - num_computed new tokens (1 when decoding), in the order of `running`"),
    ("a prompt in progress gets its next chunk, capped by the budget",
     dict(running=[_r("a", 10, 9, 3), _r("b", 40, 16, 10)], waiting=[_r("w", 5)], free_blocks=0,
          block_size=4, max_num_seqs=8, token_budget=10),
     ([("a", 1), ("b", 9)], []),
     "n = min(num_tokens - num_computed, budget left); nothing is admitted once the budget is spent"),
    ("waiting requests are admitted first-come-first-served, up to max_num_seqs",
     dict(running=[_r("a", 10, 9, 3)], waiting=[_r("w1", 6), _r("w2", 3), _r("w3", 5)], free_blocks=10,
          block_size=4, max_num_seqs=3, token_budget=64),
     ([("a", 1), ("w1", 6), ("w2", 3)], []),
     "admit from the front of `waiting` while len(running) < max_num_seqs (admitted requests count too)"),
    ("admission stops at the first request that does not fit (no skipping ahead)",
     dict(running=[_r("a", 10, 9, 3)], waiting=[_r("w1", 20), _r("w2", 2)], free_blocks=3,
          block_size=4, max_num_seqs=8, token_budget=64),
     ([("a", 1)], []),
     "w1 needs 5 blocks and only 3 are free: stop there (break, not continue), or big requests would starve"),
    ("the token budget chunks the last admitted prompt",
     dict(running=[_r("a", 10, 9, 3), _r("b", 7, 6, 2)], waiting=[_r("w1", 30), _r("w2", 4)], free_blocks=9,
          block_size=4, max_num_seqs=8, token_budget=16),
     ([("a", 1), ("b", 1), ("w1", 14)], []),
     "chunked prefill: an admitted prompt gets min(num_tokens, budget left) tokens now, the rest in later steps"),
    ("admission reserves blocks for the whole prompt, not just its first chunk",
     dict(running=[_r("a", 10, 9, 3)], waiting=[_r("w1", 30)], free_blocks=5, block_size=4, max_num_seqs=8,
          token_budget=9),
     ([("a", 1)], []),
     "admitting a request allocates ceil(num_tokens / block_size) blocks for its whole prompt (8 here, 5 free)"),
    ("out of blocks: the newest running request is preempted, and nothing is admitted",
     dict(running=[_r("a", 9, 8, 2), _r("b", 10, 9, 3), _r("c", 6, 5, 2)], waiting=[_r("w", 3)], free_blocks=0,
          block_size=4, max_num_seqs=8, token_budget=64),
     ([("a", 1), ("b", 1)], ["c"]),
     "a needs a 3rd block and none is free: preempt running[-1] (c, the newest), add its blocks to the free "
     "count, retry; after a preemption admit nobody this step"),
    ("victims are preempted newest first, one at a time",
     dict(running=[_r("a", 9, 8, 2), _r("b", 5, 4, 1), _r("c", 3, 2, 1), _r("d", 2, 1, 1)], waiting=[],
          free_blocks=0, block_size=4, max_num_seqs=8, token_budget=64),
     ([("a", 1), ("b", 1)], ["d", "c"]),
     "preempt only until the request's blocks fit: d makes room for a, then c for b"),
    ("a request that cannot get its block preempts itself",
     dict(running=[_r("a", 10, 9, 3), _r("b", 9, 8, 2)], waiting=[_r("w", 2)], free_blocks=0, block_size=4,
          max_num_seqs=8, token_budget=64),
     ([("a", 1)], ["b"]),
     "b is the newest: when it needs a block and none is free it is its own victim; stop the running loop"),
    ("nothing running: a long prompt is chunked from its first step",
     dict(running=[], waiting=[_r("w1", 50), _r("w2", 3)], free_blocks=20, block_size=4, max_num_seqs=4,
          token_budget=32),
     ([("w1", 32)], []),
     "the first chunk of w1 spends the whole budget; w2 waits for the next step"),
]


def _random_schedule_state(rng: Any) -> dict[str, Any]:
    """A random but reachable state: half of them short of blocks (preemption), half with room (admission)."""
    bs = rng.choice([2, 4])
    tight = rng.random() < 0.5
    running = []
    for i in range(rng.randrange(0, 6 if tight else 3)):
        if rng.random() < 0.7:  # decoding: the last sampled token is not computed yet
            computed = rng.randrange(1, 30)
            if tight and rng.random() < 0.5:
                computed = bs * rng.randrange(1, 8)  # its next token opens a new block
            running.append(_r(f"r{i}", computed + 1, computed, -(-computed // bs)))
        else:  # a prompt in progress: its blocks were all allocated when it was admitted
            tokens = rng.randrange(2, 40)
            running.append(_r(f"r{i}", tokens, rng.randrange(1, tokens), -(-tokens // bs)))
    waiting = [_r(f"w{i}", rng.randrange(1, 30)) for i in range(rng.randrange(0, 5))]
    return dict(running=running, waiting=waiting, free_blocks=rng.randrange(0, 3) if tight else rng.randrange(0, 25),
                block_size=bs, max_num_seqs=max(1, len(running) + rng.randrange(0, 4)),
                token_budget=rng.randrange(1, 48))


def _fmt_plan(plan: tuple[list[tuple[str, int]], list[str]]) -> str:
    scheduled, preempted = plan
    return f"scheduled {[tuple(p) for p in scheduled]}, preempted {list(preempted)}"


def check_schedule_step(fn: Callable[..., Any]) -> None:
    """Grade ``fn(running, waiting, free_blocks, block_size, max_num_seqs, token_budget) -> (scheduled,
    preempted)`` on hand-built scenarios (known answers, the same as minifer's Scheduler gives) and on random
    states compared with :class:`minifer.core.sched.scheduler.Scheduler`."""
    import random

    def normalise(got: Any) -> tuple[list[tuple[str, int]], list[str]]:
        try:
            scheduled, preempted = got
            return [(str(n), int(k)) for n, k in scheduled], [str(n) for n in preempted]
        except (TypeError, ValueError):
            raise AssertionError(f"expected (scheduled, preempted): a list of (name, num_new_tokens) pairs and a "
                                 f"list of names, got {got!r:.200}") from None

    def call(kwargs: dict[str, Any]) -> tuple[list[tuple[str, int]], list[str]]:
        running, waiting = list(kwargs["running"]), list(kwargs["waiting"])
        got = normalise(fn(running, waiting, kwargs["free_blocks"], kwargs["block_size"], kwargs["max_num_seqs"],
                           kwargs["token_budget"]))
        if running != kwargs["running"] or waiting != kwargs["waiting"]:
            raise AssertionError("your function modified the `running` or `waiting` list: work on copies "
                                 "(e.g. running = list(running)) and return the plan")
        return got

    def state(kwargs: dict[str, Any]) -> str:
        return ("state (a request is name(num_tokens, num_computed, num_blocks), a waiting one name(num_tokens)):\n"
                "  " + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()))

    def scenario(kwargs: dict[str, Any], want: tuple[list[tuple[str, int]], list[str]], hint: str) -> Check:
        def run() -> None:
            got = call(kwargs)
            if got != (list(want[0]), list(want[1])):
                raise AssertionError(f"{state(kwargs)}\ngot      {_fmt_plan(got)}\nexpected {_fmt_plan(want)}"
                                     f"\nhint: {hint}")
        return run

    def random_states(seed: int, n: int) -> Check:
        def run() -> None:
            rng = random.Random(seed)
            for _ in range(n):
                kwargs = _random_schedule_state(rng)
                want = _schedule_with_minifer(**kwargs)
                got = call(kwargs)
                if got != want:
                    raise AssertionError(f"{state(kwargs)}\ngot      {_fmt_plan(got)}\nexpected "
                                         f"{_fmt_plan(want)}\nhint: follow the policy step by step: running "
                                         f"requests first, then admission")
        return run

    checks: list[Check] = [(label, scenario(kwargs, want, hint)) for label, kwargs, want, hint in SCHEDULER_SCENARIOS]
    checks += [("200 random states, compared with minifer's Scheduler", random_states(0, 200))]
    run_checks("schedule_step", checks)


# --- preemption by recompute --------------------------------------------------------------------------------


def _preempt_diagnosis(victim: Any, before: dict[str, Any], world: Any) -> str | None:
    """What is wrong with one preemption (None if nothing), from the state before it and the victim returned."""
    from minifer.request import Request, RequestStatus

    newest, oldest = before["running"][-1], before["running"][0]
    sched, blocks = world.scheduler, world.blocks
    if not isinstance(victim, Request):
        return f"returned {victim!r:.60}, expected the preempted sequence\nhint: return the sequence you preempted"
    if victim.request_id != newest:
        why = "the oldest" if victim.request_id == oldest and len(before["running"]) > 1 else repr(victim.request_id)
        return (f"preempted {why}, expected the newest running request {newest!r}\nhint: the victim is running[-1] "
                "(running.pop()): the newest has the least work to lose, and the oldest keep their first-come-"
                "first-served place")
    if victim in sched.running:
        return "the victim is still in `running`\nhint: take it out: victim = running.pop()"
    if blocks.has_seq(victim.request_id) or blocks.num_free_blocks != before["free_blocks"] + before["victim_blocks"]:
        return (f"{blocks.num_free_blocks} blocks free, expected {before['free_blocks'] + before['victim_blocks']}"
                "\nhint: free its blocks, blocks.free(victim.request_id): that is what preemption is for")
    if victim.num_computed_tokens != 0:
        return (f"the victim's num_computed_tokens is {victim.num_computed_tokens}, expected 0\nhint: its blocks are "
                "freed, so none of its KV is in the cache any more: reset num_computed_tokens to 0 so that it is "
                "recomputed when it is admitted again")
    if list(victim.output_token_ids) != before["victim_tokens"]:
        return ("the victim lost the tokens it generated\nhint: keep output_token_ids as they are: recomputation "
                "runs its prompt and generated tokens again (all_token_ids) and continues after them")
    if victim.status is not RequestStatus.WAITING:
        return f"the victim's status is {victim.status}\nhint: set victim.status = RequestStatus.WAITING"
    waiting = [s.request_id for s in sched.waiting]
    if waiting != [victim.request_id] + before["waiting"]:
        where = ("at the back" if waiting == before["waiting"] + [victim.request_id] else
                 "missing" if victim.request_id not in waiting else "misplaced")
        return (f"waiting is {waiting}: the victim is {where}\nhint: put it at the front, waiting.appendleft(victim): "
                "it arrived before every request still waiting")
    return None


def _preempt_case(fn: Callable[..., Any], prompts: list[int], max_tokens: int, steps: int, max_num_seqs: int) -> Check:
    """Advance a toy engine ``steps`` steps with the reference, then preempt once with ``fn``."""
    def run() -> None:
        from minifer.engine.core import engine_step
        from minifer_course.grading.toy_engine import build_world

        world = build_world([[7 + i] * p for i, p in enumerate(prompts)], [max_tokens] * len(prompts), num_blocks=64,
                            max_num_seqs=max_num_seqs)
        for _ in range(steps):
            engine_step(world.parts)
        sched, blocks = world.scheduler, world.blocks
        victim_id = sched.running[-1].request_id
        before = {"running": [s.request_id for s in sched.running], "waiting": [s.request_id for s in sched.waiting],
                  "free_blocks": blocks.num_free_blocks, "victim_blocks": len(blocks.block_table(victim_id)),
                  "victim_tokens": list(sched.running[-1].output_token_ids)}
        victim = fn(sched.running, sched.waiting, blocks)
        problem = _preempt_diagnosis(victim, before, world)
        if problem:
            raise AssertionError(f"running {before['running']}, waiting {before['waiting']}: {problem}")
    return run


def _served_with_preemption(fn: Callable[..., Any], sampled: bool, num_blocks: int, seed: int) -> Check:
    """A whole workload in a cache that is too small, the scheduler preempting through ``fn``: the same tokens and
    the same number of preemptions as with minifer's preemption."""
    def run() -> None:
        import random

        from minifer.core.sched.scheduler import Scheduler
        from minifer.engine.core import engine_step
        from minifer_course.grading.toy_engine import build_world, run_to_end

        class Learners(Scheduler):
            preempt = staticmethod(fn)

        rng = random.Random(seed)
        prompts = [[rng.randrange(60) for _ in range(rng.randrange(3, 12))] for _ in range(6)]
        lens = [rng.randrange(4, 14) for _ in prompts]
        want = run_to_end(build_world(prompts, lens, num_blocks, sampled=sampled), engine_step)
        got = run_to_end(build_world(prompts, lens, num_blocks, sampled=sampled, scheduler=Learners), engine_step)
        if want[-1]["preemptions"] == 0:
            raise RuntimeError("this workload must preempt")  # the grader's own precondition
        for key in ("tokens", "preemptions"):
            if got[-1][key] != want[-1][key]:
                raise AssertionError(f"after the whole workload, {key}: {got[-1][key]}, expected {want[-1][key]}\n"
                                     "hint: the single-preemption checks above pass, so look at what the scheduler "
                                     "does next: it re-admits the victim from the front of `waiting` with "
                                     "all_token_ids and num_computed_tokens = 0")
    return run


def check_preempt(fn: Callable[..., Any]) -> None:
    """Grade ``fn(running, waiting, blocks) -> victim`` against :func:`minifer.core.sched.scheduler.preempt_by_recompute`:
    single preemptions in a toy engine's real scheduler state, then whole workloads in a cache too small for them,
    with the scheduler preempting through ``fn`` (tokens and preemption counts compared)."""
    checks: list[Check] = [
        ("three decoding requests: the newest is the victim", _preempt_case(fn, [5, 9, 3], 8, 3, 3)),
        ("a request waits: the victim goes in front of it", _preempt_case(fn, [5, 9, 3, 4], 8, 3, 3)),
        ("a victim that has generated tokens keeps them", _preempt_case(fn, [6, 6], 12, 6, 2)),
        ("the only running request", _preempt_case(fn, [10], 8, 2, 1)),
        ("a cache too small: greedy requests preempted and recomputed, the reference's tokens",
         _served_with_preemption(fn, False, 9, 0)),
        ("a cache too small: seeded sampled requests, the reference's tokens", _served_with_preemption(fn, True, 8, 1)),
    ]
    run_checks("preempt", checks)


# --- after the forward pass: the scheduler's update_from_output ----------------------------------------------------

_STEP_HINTS = {
    "returned": "return `sampled`, the sequences that drew a token, as they came",
    "num_computed_tokens": "first add each scheduled sequence's new tokens to its num_computed_tokens "
                           "(zip(batch.seqs, batch.num_new_tokens)): their KV is in the cache, the next step starts there",
    "tokens": "append a token to the sequences of `sampled` only (a prompt chunk before its last one drew none): "
              "zip(sampled, result.token_ids, result.sampled_logprob, result.logprobs), then "
              "seq.append_token(token, logprob, entry, tokenizer)",
    "finished": "append_token finishes a sequence at its stop token or length: append every sampled token",
    "running": "free every sampled sequence that finished, after appending its token: self.finish(seq) takes it out "
               "of `running` and returns its blocks (checked before appending, nothing has finished yet)",
    "free_blocks": "a finished sequence's blocks go back with self.finish(seq), once it has finished",
    "cached_blocks": "publish every scheduled sequence's computed tokens to the prefix cache: self.blocks."
                     "register_computed(seq.request_id, seq.token_slice(0, seq.num_computed_tokens)), finished ones "
                     "included (before freeing them)",
}
_STEP_ORDER = ("returned", "num_computed_tokens", "tokens", "finished", "running", "free_blocks", "cached_blocks",
               "waiting", "preemptions")


def _step_case(fn: Callable[..., Any], prompts: list[list[int]], max_tokens: list[int], eos_from: int | None = None,
               **world: Any) -> Check:
    """Two toy engines stepped by minifer's ``engine_step``, one with minifer's ``Scheduler``, one whose
    ``update_from_output`` is ``fn``: compared after every step. ``eos_from``: the EOS is the token the reference
    samples third for request ``eos_from`` (so it stops early)."""
    def run() -> None:
        from minifer.engine.core import engine_step
        from minifer_course.grading.toy_engine import build_world, run_to_end, snapshot
        from minifer_course.workbench_step import scheduler_with_update

        eos = None
        if eos_from is not None:
            eos = run_to_end(build_world(prompts, max_tokens, **world), engine_step)[-1]["tokens"][f"r{eos_from}"][2]
        ref = build_world(prompts, max_tokens, eos=eos, **world)
        mine = build_world(prompts, max_tokens, eos=eos, scheduler=scheduler_with_update(fn), **world)
        for k in range(1, 400):
            if not ref.scheduler.has_unfinished():
                return
            want_ret = [s.request_id for s in engine_step(ref.parts)]
            try:
                got = engine_step(mine.parts)
            except KeyError as e:
                raise AssertionError(f"step {k}: your update_from_output raised KeyError {e} in the block allocator\n"
                                     "hint: a sequence's blocks are gone once self.finish(seq) frees it: append and "
                                     "register_computed first, free last") from None
            got_ret = [getattr(s, "request_id", s) for s in got] if isinstance(got, (list, tuple)) else got
            want, have = {"returned": want_ret, **snapshot(ref)}, {"returned": got_ret, **snapshot(mine)}
            for key in _STEP_ORDER:
                if have[key] != want[key]:
                    raise AssertionError(f"after step {k}, {key}: {have[key]!r:.300}\nexpected {want[key]!r:.300}\n"
                                         f"hint: {_STEP_HINTS.get(key, 'count computed, append, cache, free')}")
    return run


def _random_step_case(fn: Callable[..., Any], seed: int) -> Check:
    import random

    rng = random.Random(seed)
    prompts = [[rng.randrange(60) for _ in range(rng.randrange(1, 20))] for _ in range(rng.randrange(2, 8))]
    return _step_case(fn, prompts, [rng.randrange(1, 12) for _ in prompts], num_blocks=rng.randrange(10, 40),
                      max_num_seqs=rng.randrange(1, 6), token_budget=rng.randrange(4, 40), sampled=rng.random() < .5)


def check_update_from_output(fn: Callable[..., Any]) -> None:
    """Grade ``fn(self, batch, sampled, result, tokenizer=None) -> sampled`` as ``Scheduler.update_from_output``:
    toy engines (``toy_engine``: minifer's scheduler, allocator and sampler around a model-free runner) stepped by
    minifer's ``engine_step``, one with minifer's scheduler and one with ``fn`` in it, compared after every step: what
    it returned, every sequence's tokens and computed count, who runs, who waits, free and cached blocks."""
    opening = list(range(1, 13))  # three blocks of 4 that two prompts share
    checks: list[Check] = [
        ("one request: its prompt, then one token per step", _step_case(fn, [[3, 1, 4, 1, 5]], [6], num_blocks=8)),
        ("four requests of different lengths: finished ones leave and free their blocks", _step_case(
            fn, [[5, 6, 7], [8, 9], [1, 2, 3, 4, 5, 6], [9]], [3, 7, 5, 2], num_blocks=16)),
        ("a long prompt in chunks of a token budget of 8: no token before its last chunk", _step_case(
            fn, [list(range(20)), [4, 4]], [4, 4], num_blocks=16, token_budget=8)),
        ("two prompts share an opening: computed blocks join the prefix cache", _step_case(
            fn, [opening + [20], opening + [30, 31]], [5, 5], num_blocks=16, max_num_seqs=1)),
        ("a stop token ends a request early", _step_case(fn, [[5, 5, 5], [6, 6]], [10, 10], eos_from=0, num_blocks=16)),
        ("a cache too small for all: preemption, then recomputation", _step_case(
            fn, [[1] * 7, [2] * 6, [3] * 5, [4] * 7], [9, 9, 9, 9], num_blocks=9)),
        ("sampled requests with a seed each", _step_case(fn, [[1, 2], [3, 4, 5], [6]], [6, 6, 6], num_blocks=16,
                                                         sampled=True)),
    ]
    checks += [(f"random workload {i}", _random_step_case(fn, i)) for i in range(6)]
    run_checks("update_from_output", checks)


def check_preemptions_in_engine(preempt: Callable[..., Any]) -> None:
    """Serve ``preempt``'s workload (a cache too small for it) with the learner's preemption and with minifer's: both
    engines preempt, and equally often (the count is the scheduler's, the same on every machine)."""
    from minifer_course import workbench

    workload, counts = workbench.WORKLOADS["preempt"], {}

    def count(label: str, components: Any) -> Callable[[], None]:
        def run() -> None:
            llm = workbench.engine(components, workload)
            workbench.tokens(llm, workload)
            counts[label] = llm.engine.stats()["num_preemptions"]
        return run

    def compare() -> None:
        if not counts["ref"]:
            raise RuntimeError("this workload must preempt")  # the grader's own precondition
        if counts["mine"] != counts["ref"]:
            raise AssertionError(f"your preemption ran {counts['mine']} times, minifer's {counts['ref']}\nhint: one "
                                 "victim per call, the newest running request")

    def graded() -> None:  # a preemption that keeps its victim running would never let the engine's step end
        import contextlib
        import io

        try:
            with contextlib.redirect_stdout(io.StringIO()):
                check_preempt(preempt)
        except AssertionError as e:
            raise AssertionError(f"it does not go into the engine until it passes its checks:\n{e}") from None

    run_checks("preempt, counted", [
        ("your preempt passes its checks", graded),
        (f"minifer's engine serves {workload.describe()}", count("ref", None)),
        ("the engine with your preempt serves them too",
         count("mine", workbench.components_from({"preempt": preempt}))),
        ("they preempt equally often, and more than never", compare),
    ])

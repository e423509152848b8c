"""One request's n completions never hold more than half the running slots while another request waits."""

from __future__ import annotations

from minifer.core.kv_cache_manager import KVCacheManager
from minifer.core.sched.scheduler import Scheduler, SchedulerConfig
from minifer.request import ParentRequest, Request
from minifer.sampling_params import SamplingParams


def _request(rid: str, n: int = 1) -> Request | ParentRequest:
    seq = Request(rid, None, [1, 2, 3], SamplingParams(n=n, max_tokens=4), 4, frozenset())
    return ParentRequest.fan_out(seq) if n > 1 else seq


def _scheduler(max_num_seqs: int) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs), KVCacheManager(64, 4, False))


def test_a_request_behind_eight_completions_is_admitted_in_the_same_step():
    sched = _scheduler(max_num_seqs=4)
    for s in _request("many", n=8).seqs:
        sched.add(s)
    sched.add(_request("one"))
    running = [s.request_id for s in sched.schedule().seqs]
    assert running == ["0_many", "1_many", "one"]  # two completions (half of 4 slots), then the waiting request


def test_with_nobody_else_waiting_the_completions_take_every_slot():
    sched = _scheduler(max_num_seqs=4)
    for s in _request("many", n=8).seqs:
        sched.add(s)
    assert [s.request_id for s in sched.schedule().seqs] == ["0_many", "1_many", "2_many", "3_many"]


def test_single_requests_keep_first_come_first_served():
    sched = _scheduler(max_num_seqs=2)
    for rid in "abc":
        sched.add(_request(rid))
    assert [s.request_id for s in sched.schedule().seqs] == ["a", "b"]


def test_a_request_arriving_after_the_completions_took_every_slot_gets_half_back():
    """Admitted while nobody waited, eight completions hold all 4 slots; a request that arrives then preempts the
    newest two (they recompute later) and runs at the next step, instead of waiting for the completions to finish."""
    sched = _scheduler(max_num_seqs=4)
    for s in _request("many", n=8).seqs:
        sched.add(s)
    assert len(sched.schedule().seqs) == 4
    sched.add(_request("late"))
    step = sched.schedule()
    assert [s.request_id for s in step.preempted] == ["3_many", "2_many"]
    assert [s.request_id for s in sched.schedule().seqs][-1] == "late"
    assert sum(s.parent_id == "many" for s in sched.running) == 2

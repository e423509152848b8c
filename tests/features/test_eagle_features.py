"""The features an EAGLE head has not read yet (``KeptFeatures``): what it reads back is what the target's forwards
wrote, position by position, through appends, the overwrites after rejected drafts and reads; and while nothing
reads (adaptive k holding plain decoding), a step's write copies nothing that was kept before."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minifer.spec_decode.eagle import KeptFeatures

H = 3


def _rows(start: int, n: int, tag: int) -> torch.Tensor:
    """Rows whose values name their position and the forward that wrote them."""
    return torch.tensor([[p, tag, 0.5] for p in range(start, start + n)], dtype=torch.float32).reshape(n, H)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6), st.integers(0, 5)), min_size=1, max_size=30))
def test_reads_return_what_the_last_forward_wrote_at_each_position(ops):
    """Against a reference that keeps one dict of position -> row: every read matches it."""
    kept = KeptFeatures(10, _rows(10, 3, tag=0))
    ref = {p: _rows(p, 1, 0)[0] for p in range(10, 13)}
    for tag, (is_read, back, n) in enumerate(ops, start=1):
        if is_read:
            if kept.end <= kept.p0:
                continue
            start = kept.p0 + back % (kept.end - kept.p0)
            stop = start + 1 + n % (kept.end - start)
            got = kept.take(start, stop)
            assert torch.equal(got, torch.stack([ref[p] for p in range(start, stop)]))
            ref = {p: r for p, r in ref.items() if p >= stop}
            assert kept.p0 == stop
        else:
            start = max(kept.p0, kept.end - back)  # a verification rewrites the last few positions, or appends
            kept.write(start, _rows(start, n, tag))
            ref = {p: r for p, r in ref.items() if p < start} | {p: _rows(p, 1, tag)[0] for p in range(start, start + n)}
        assert (kept.p0, kept.end) == ((min(ref), max(ref) + 1) if ref else (kept.p0, kept.p0))
        assert sum(len(c) for c in kept.chunks) == kept.end - kept.p0


def test_a_held_step_appends_without_copying_the_history():
    first = _rows(0, 100, tag=0)
    kept = KeptFeatures(0, first)
    for step in range(50):
        kept.write(100 + step, _rows(100 + step, 1, tag=step + 1))
    assert kept.chunks[0] is first  # the prompt's features were never copied again
    assert len(kept.chunks) == 51 and kept.end == 150
    assert torch.equal(kept.take(120, 150)[:, 0], torch.arange(120, 150, dtype=torch.float32))
    assert len(kept.chunks) == 1 and kept.p0 == 150 and len(kept.chunks[0]) == 0

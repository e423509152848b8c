"""Exercise 02's ``ForkingAllocator`` serving the requests whose sequences share blocks: parallel sampling (``n``
completions of a prompt, which find its blocks in the prefix cache) and beam search (beams that fork and copy on
write), in a real engine, against the reference engine's outputs. Separate from ``check_in_engine`` because
neither fits its one-completion workloads."""

from __future__ import annotations

import contextlib
import io
from typing import Any

from minifer_course.grading.base import Check, run_checks
from minifer_course.grading.paging import check_forking_allocator


def check_forking_in_engine(cls: Any) -> None:
    """Grade ``cls`` (a ``ForkingAllocator``), then serve ``n=3`` seeded completions of every prompt and a beam search
    of width 4 with it as the engine's allocator: every completion and every beam must be the reference engine's."""
    from minifer import BeamSearchParams, SamplingParams
    from minifer_course import workbench

    served: dict[str, Any] = {}
    parallel = [SamplingParams(temperature=0.8, max_tokens=12, n=3, seed=i, ignore_eos=True)
                for i in range(len(workbench.PROMPTS))]
    beams = BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True)

    def graded() -> None:  # a fork that shares a table's list object would corrupt the engine's blocks
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                check_forking_allocator(cls)
        except AssertionError as e:
            raise AssertionError(f"it does not go into the engine until it passes its checks:\n{e}") from None

    def serve(label: str, components: Any) -> Check:
        def run() -> None:
            llm = workbench.engine(components)
            outs = llm.generate(workbench.PROMPTS, parallel, use_tqdm=False)
            served[label] = ([[c.token_ids for c in o.outputs] for o in outs],
                             [[s.tokens for s in b.sequences] for b in llm.beam_search(workbench.PROMPTS[:2], beams)])
        return run

    def same(i: int, what: str, hint: str) -> Check:
        def run() -> None:
            got, want = served["mine"][i], served["ref"][i]
            bad = next((j for j, (g, w) in enumerate(zip(got, want)) if g != w), None)
            if bad is not None:
                raise AssertionError(f"{what} of prompt {bad} ({workbench.PROMPTS[bad]!r}) differ from the reference "
                                     f"engine's\nhint: {hint}")
        return run

    mine = workbench.components_from({"ForkingAllocator": cls})
    run_checks("ForkingAllocator, sharing blocks in the engine", [
        ("your ForkingAllocator passes its checks", graded),
        ("minifer's engine serves 8 prompts x 3 seeded completions, and beam search (width 4) on 2",
         serve("ref", None)),
        ("the engine with your allocator serves them too", serve("mine", mine)),
        ("every completion is the reference engine's (n=3: the prefix cache shares each prompt)",
         same(0, "the completions", "a completion reads its prompt's blocks from the prefix cache: lookup_prefix and "
                                    "allocate must hand out only verified, computed blocks")),
        ("every beam is the reference engine's (fork and copy-on-write)",
         same(1, "the beams", "a beam about to write into a block another beam holds must copy it first "
                              "(copy_on_write returns (shared, fresh)), or it overwrites its siblings' keys and values")),
    ])

"""The graders of exercise 04's engine pieces (``minifer_course.grading.spec_step``): minifer's rule and head pass,
and each classic mistake fails with the hint that names it."""

from __future__ import annotations

import pytest
import torch

from minifer_course.grading import spec_step
from minifer_course.workbench_spec import KVView


def test_the_references_pass(capsys):
    spec_step.check_rollback(spec_step.reference_rollback)
    spec_step.check_eagle_forward(spec_step.reference_eagle_forward)
    out = capsys.readouterr().out
    assert "rollback: 8/8 checks passed" in out and "eagle_forward: 4/4 checks passed" in out


# --- rollback: the classic mistakes ---------------------------------------------------------------------------


def _rollback(token_ids, k, accepted, target: KVView, draft: KVView | None, *, extra_kv=0, free=True,
              draft_rule="min", ceil=True, drop_tokens=True):
    """The exercise's rollback with switches for the classic mistakes."""
    keep = len(token_ids) - k + accepted
    if drop_tokens:
        del token_ids[keep:]

    def cut(cache: KVView, n: int) -> None:
        cache.num_tokens = n
        blocks = -(-n // cache.block_size) if ceil else n // cache.block_size + 1
        while free and len(cache.block_table) > blocks:
            cache.free_blocks.append(cache.block_table.pop())

    cut(target, keep + extra_kv)
    if draft is not None:
        n = {"min": min(draft.num_tokens, keep), "kept": keep, "untouched": draft.num_tokens,
             "target_before": keep + (k - accepted)}[draft_rule]
        cut(draft, n)


ROLLBACK_MISTAKES = [
    (dict(extra_kv=1), "keeping one more is the classic off-by-one"),
    (dict(free=False), "goes back to the pool"),
    (dict(draft_rule="kept"), "never the last one"),
    (dict(draft_rule="untouched"), "never the last one"),
    (dict(draft_rule="target_before"), "never the last one"),
    (dict(ceil=False), "goes back to the pool"),
    (dict(drop_tokens=False), "drop the k - accepted rejected drafts"),
]


def test_the_switchable_rollback_without_mistakes_passes():
    spec_step.check_rollback(lambda *a: _rollback(*a))


@pytest.mark.parametrize("switches, hint", ROLLBACK_MISTAKES, ids=lambda v: str(v) if isinstance(v, dict) else None)
def test_each_rollback_mistake_is_rejected_with_its_hint(switches, hint):
    with pytest.raises(AssertionError, match="rollback: check") as err:
        spec_step.check_rollback(lambda *a: _rollback(*a, **switches))
    assert hint in str(err.value)


# --- the EAGLE head's forward: the classic mistakes ---------------------------------------------------------


def _eagle(head, features, input_ids, positions, attn, *, order="feature first", norm=True, fuse=True, layer=True,
           own_attn=False):
    """The exercise's forward with switches for the classic mistakes."""
    emb = head.embed_tokens(input_ids)
    pair = [features, emb] if order == "feature first" else [emb, features]
    x = head.fc(torch.cat(pair, dim=-1)) if fuse else features
    if layer:
        cos, sin = head.rotary(positions, x.dtype)
        x = head.layer(x, cos, sin, spec_step.CausalAttention() if own_attn else attn)
    return head.norm(x) if norm else x


EAGLE_MISTAKES = [
    (dict(order="embedding first"), "[feature, embedding] in that order"),
    (dict(norm=False), "ends with its own RMSNorm"),
    (dict(fuse=False), "fuse the feature with the token's embedding"),
    (dict(layer=False), "through the decoder layer"),
    (dict(own_attn=True), "pass attn to the decoder layer"),
]


def test_the_switchable_forward_without_mistakes_passes():
    spec_step.check_eagle_forward(lambda *a: _eagle(*a))


@pytest.mark.parametrize("switches, hint", EAGLE_MISTAKES, ids=lambda v: str(v) if isinstance(v, dict) else None)
def test_each_eagle_mistake_is_rejected_with_its_hint(switches, hint):
    with pytest.raises(AssertionError, match="eagle_forward: check") as err:
        spec_step.check_eagle_forward(lambda *a: _eagle(*a, **switches))
    assert hint in str(err.value)


def test_returning_logits_instead_of_features_is_named():
    def logits_out(head, features, input_ids, positions, attn):
        return head.logits(spec_step.reference_eagle_forward(head, features, input_ids, positions, attn))

    with pytest.raises(AssertionError, match="return the head's output before the LM head"):
        spec_step.check_eagle_forward(logits_out)

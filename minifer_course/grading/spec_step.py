"""Graders for the speculative step's engine pieces of exercise 04 (``minifer_course.workbench_spec`` plugs them in).

* :func:`check_rollback` grades ``fn(token_ids, k, accepted, target, draft)``, the rollback after a verification:
  hand-built steps whose expected state is written out (the off-by-one that keeps the KV of the target's own token,
  the block left allocated, the draft cut to a length it never computed) and random ones against
  :func:`reference_rollback`;
* :func:`check_eagle_forward` grades ``fn(head, features, input_ids, positions, attn)``, the EAGLE head's forward,
  on the shipped head and the target's own features of a fixed story: its output and logits against
  ``EagleHead.forward``'s, a forward split in two chunks over a cache, and the share of next tokens it drafts
  right (teacher-forced). A wrong output is compared with the classic mistakes' to name the one made.

The tests (``tests/course/test_workbench_spec.py``) check that the references pass and each classic mistake fails.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from minifer_course.grading.base import Check, assert_close, run_checks
from minifer_course.workbench_spec import KVView

__all__ = ["check_eagle_forward", "check_rollback", "reference_eagle_forward", "reference_rollback"]


# --- the rollback -------------------------------------------------------------------------------------------


def reference_rollback(token_ids: list[int], k: int, accepted: int, target: KVView, draft: KVView | None) -> None:
    """The exercise's answer, the rule ``Speculator.rollback`` applies: the sequence keeps its context and the
    accepted drafts; the target keeps the KV of exactly those tokens (the token it emits next is computed in the next
    step); the draft keeps what it computed of them (it never ran its last draft token); emptied blocks are freed."""
    keep = len(token_ids) - k + accepted
    del token_ids[keep:]
    for cache, n in ((target, keep), (draft, None if draft is None else min(draft.num_tokens, keep))):
        if cache is None:
            continue
        cache.num_tokens = n
        while len(cache.block_table) > -(-n // cache.block_size):
            cache.free_blocks.append(cache.block_table.pop())


def _step(n: int, k: int, accepted: int, draft_computed: int | None, block_size: int = 4,
          seed: int = 0) -> tuple[list[int], KVView, KVView | None]:
    """A verified step's state: ``n`` context tokens then ``k`` drafts; the target wrote KV for all ``n + k`` of them,
    the draft model for ``draft_computed``; block ids drawn without repeats (so a freed block is recognisable)."""
    rng = random.Random(seed)
    ids = rng.sample(range(100), 2 * (-(-(n + k) // block_size)) + 2)
    tokens = [rng.randrange(1000) for _ in range(n + k)]
    nt = -(-(n + k) // block_size)
    target = KVView(n + k, ids[:nt], block_size, [])
    draft = None
    if draft_computed is not None:
        draft = KVView(draft_computed, ids[nt : nt + -(-draft_computed // block_size)], block_size, [])
    return tokens, target, draft


KEEP_KV = ("the target keeps the KV of the tokens left in token_ids, len(token_ids) - k + accepted of them: the token "
           "the target emits after the accepted drafts has no KV yet (the next step's forward computes it), so "
           "keeping one more is the classic off-by-one")
FREE = ("a block the shorter cache no longer reaches goes back to the pool: while len(block_table) > "
        "ceil(num_tokens / block_size), append block_table.pop() to free_blocks")
DRAFT_LEN = ("the draft model fed the context and its first k - 1 drafts, never the last one: it holds "
             "draft.num_tokens = n + k - 1 tokens; keep min(draft.num_tokens, the tokens kept), not more (an "
             "all-accepted step would claim KV it never computed) and not fewer")


def _compare(fn: Callable[..., Any], n: int, k: int, accepted: int, draft_computed: int | None,
             block_size: int = 4, seed: int = 0) -> None:
    got_state, want_state = _step(n, k, accepted, draft_computed, block_size, seed), _step(
        n, k, accepted, draft_computed, block_size, seed)
    fn(*_args(got_state, k, accepted))
    reference_rollback(*_args(want_state, k, accepted))
    where = (f"a step with {n} context tokens and k = {k} drafts, {accepted} accepted (block_size {block_size}"
             + (f", the draft model had computed {draft_computed} tokens)" if draft_computed is not None else ")"))
    (tokens, target, draft), (w_tokens, w_target, w_draft) = got_state, want_state
    if tokens != w_tokens:
        raise AssertionError(f"{where}: token_ids keeps {len(tokens)} tokens, expected {len(w_tokens)}\nhint: drop "
                             f"the k - accepted rejected drafts from the end: del token_ids[len(token_ids) - k + "
                             f"accepted:]")
    for which, got, want in (("target", target, w_target), ("draft", draft, w_draft)):
        if want is None:
            continue
        for field in ("num_tokens", "block_table", "free_blocks"):
            g, w = getattr(got, field), getattr(want, field)
            if (sorted(g) != sorted(w)) if field == "free_blocks" else g != w:
                hint = FREE if field != "num_tokens" else KEEP_KV if which == "target" else DRAFT_LEN
                raise AssertionError(f"{where}: the {which}'s {field} is {g}, expected {w}\nhint: {hint}")


def _args(state: tuple[list[int], KVView, KVView | None], k: int, accepted: int) -> tuple:
    tokens, target, draft = state
    return tokens, k, accepted, target, draft


def check_rollback(fn: Callable[[list[int], int, int, KVView, KVView | None], None]) -> None:
    """Grade ``fn(token_ids, k, accepted, target, draft)``, which changes its arguments in place."""
    def rand_steps() -> None:
        rng = random.Random(1)
        for seed in range(200):
            n, k, bs = rng.randrange(1, 40), rng.randrange(0, 7), rng.choice([1, 2, 4, 16])
            accepted = rng.randrange(0, k + 1)
            with_draft = seed % 2 == 0 and k > 0
            _compare(fn, n, k, accepted, n + k - 1 if with_draft else None, bs, seed)

    checks: list[Check] = [
        ("one of four drafts accepted: the rejected ones go, with the block they emptied",
         lambda: _compare(fn, 6, 4, 1, None)),
        ("the cut lands on a block boundary: exactly the blocks past it are freed",
         lambda: _compare(fn, 8, 3, 0, None)),
        ("a rejection frees a block of the target's", lambda: _compare(fn, 7, 4, 0, None)),
        ("every draft accepted: nothing to drop, nothing to free", lambda: _compare(fn, 5, 3, 3, None)),
        ("every draft accepted, with a draft model: it keeps only what it computed",
         lambda: _compare(fn, 5, 3, 3, 7)),
        ("a rejection, with a draft model: its cache is cut back too, and its emptied block freed",
         lambda: _compare(fn, 7, 4, 0, 10)),
        ("k = 0 (no draft this step): nothing changes", lambda: _compare(fn, 9, 0, 0, None)),
        ("200 random steps (block sizes 1 to 16), compared with minifer's rule", rand_steps),
    ]
    run_checks("rollback", checks)


# --- the EAGLE head's forward ----------------------------------------------------------------------------------

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. One day, she "
         "saw a big red ball in the park. She ran to the ball and kicked it as far as she could.")


def reference_eagle_forward(head: Any, features: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                            attn: Any) -> torch.Tensor:
    """``EagleHead.forward`` with the exercise's signature."""
    return head(features, input_ids, positions, attn)


class CausalAttention:
    """Attention for one sequence over a growing contiguous cache: each call's queries see every earlier key and the
    keys of their own call up to themselves (what the engine's paged cache gives one sequence)."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        past = self.k[layer].shape[0] if layer in self.k else 0
        self.k[layer] = torch.cat([self.k[layer], k]) if past else k
        self.v[layer] = torch.cat([self.v[layer], v]) if past else v
        total = past + k.shape[0]
        mask = torch.arange(total)[None, :] <= torch.arange(past, total)[:, None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), self.k[layer].transpose(0, 1),
                                             self.v[layer].transpose(0, 1), attn_mask=mask, enable_gqa=True)
        return out.transpose(0, 1)


@functools.lru_cache(maxsize=1)
def story_inputs() -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The shipped head, and its teacher-forced inputs along ``STORY``: the target's feature of positions
    ``0 .. T-2``, the tokens of positions ``1 .. T-1``, the positions, and the target's next tokens (``2 .. T-1``)."""
    from minifer.model_loader import resolve_model
    from minifer.models.llama_eagle import load_eagle_head
    from minifer_course.workbench import reference_llm

    llm = reference_llm()
    target = llm.model
    head = load_eagle_head(resolve_model("tinystories-target-eagle"), target, target.lm_head.weight.dtype)
    ids = torch.tensor(llm.get_tokenizer()(STORY)["input_ids"])
    with torch.inference_mode():
        feats = target(ids, torch.arange(len(ids)), CausalAttention())
    return head, feats[:-1].clone(), ids[1:].clone(), torch.arange(len(ids) - 1), ids[2:].clone()


def _mistakes(head: Any, feats: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor) -> list[tuple[torch.Tensor, str]]:
    """What the classic mistakes output on the same inputs."""
    emb = head.embed_tokens(ids)
    cos, sin = head.rotary(pos, feats.dtype)

    def layer(x: torch.Tensor) -> torch.Tensor:
        return head.layer(x, cos, sin, CausalAttention())

    return [
        (head.norm(layer(head.fc(torch.cat([emb, feats], -1)))),
         "the fusion map reads [feature, embedding] in that order: torch.cat([features, embed(input_ids)], dim=-1)"),
        (layer(head.fc(torch.cat([feats, emb], -1))),
         ("the head ends with its own RMSNorm (head.norm): the target's features are post-norm, so the head "
          "predicts in that space")),
        (head.norm(layer(feats)), "fuse the feature with the token's embedding first (head.fc over both)"),
        (head.norm(head.fc(torch.cat([feats, emb], -1))),
         "run the fused vector through the decoder layer (head.layer(x, cos, sin, attn))"),
    ]


def _diagnose(out: torch.Tensor, head: Any, feats: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor) -> str:
    for wrong, hint in _mistakes(head, feats, ids, pos):
        if out.shape == wrong.shape and torch.allclose(out.float(), wrong.float(), atol=1e-4, rtol=1e-4):
            return hint
    return ("x = head.fc(cat([features, embed(input_ids)])); cos, sin = head.rotary(positions, x.dtype); "
            "head.norm(head.layer(x, cos, sin, attn))")


def check_eagle_forward(fn: Callable[..., torch.Tensor]) -> None:
    """Grade ``fn(head, features, input_ids, positions, attn) -> predicted features`` on the shipped head."""
    head, feats, ids, pos, nxt = story_inputs()
    got: dict[str, torch.Tensor] = {}

    def call(f: torch.Tensor, i: torch.Tensor, p: torch.Tensor, attn: Any) -> torch.Tensor:
        with torch.inference_mode():
            out = fn(head, f.clone(), i.clone(), p.clone(), attn)
        if not isinstance(out, torch.Tensor) or out.shape != f.shape:
            raise AssertionError(f"expected the predicted features, a tensor of shape {list(f.shape)} (one row per "
                                 f"input row), got {getattr(out, 'shape', type(out).__name__)}\nhint: return the "
                                 f"head's output before the LM head: the proposer feeds it back as the next feature")
        return out

    def want() -> torch.Tensor:
        with torch.inference_mode():
            return head(feats, ids, pos, CausalAttention())

    def same_features() -> None:
        got["out"] = call(feats, ids, pos, CausalAttention())
        assert_close(got["out"], want(), atol=1e-4, rtol=1e-4, what="predicted features",
                     hint=_diagnose(got["out"], head, feats, ids, pos))

    def same_logits() -> None:
        with torch.inference_mode():
            assert_close(head.logits(got["out"]), head.logits(want()), atol=1e-3, rtol=1e-3, what="draft logits",
                         hint="the logits are head.logits(your features): if the features match, so do these")

    def chunks() -> None:
        attn, cut = CausalAttention(), len(ids) // 2
        two = torch.cat([call(feats[:cut], ids[:cut], pos[:cut], attn), call(feats[cut:], ids[cut:], pos[cut:], attn)])
        assert_close(two, want(), atol=1e-4, rtol=1e-4, what="features of a forward in two chunks",
                     hint="pass attn to the decoder layer (it holds the earlier chunks' keys) and rotate by `positions`")

    def drafts_as_often() -> None:
        with torch.inference_mode():
            mine = head.logits(got["out"][:-1]).argmax(-1) == nxt
            ref = head.logits(want()[:-1]).argmax(-1) == nxt
        if int(mine.sum()) != int(ref.sum()):
            raise AssertionError(f"your head drafts the target's next token right at {int(mine.sum())} of "
                                 f"{len(nxt)} positions, minifer's at {int(ref.sum())}")

    checks: list[Check] = [
        ("its features equal the shipped head's along a story (teacher-forced)", same_features),
        ("so do its draft logits (the target's LM head over them)", same_logits),
        ("a forward in two chunks over a cache equals one forward", chunks),
        ("it drafts the target's next token as often as minifer's head", drafts_as_often),
    ]
    run_checks("eagle_forward", checks)

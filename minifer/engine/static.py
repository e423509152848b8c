"""Static batching: the baseline that continuous batching is measured against (chapters 00 and 03).

Requests are cut into batches of ``batch_size`` in arrival order. Each batch is left-padded to its longest
prompt, prefilled in one forward, then decoded one token per step *until its longest request finishes*:
rows that finished early keep occupying their slot (computing padding), and no new request may join.
Every row also reserves KV memory up front for the batch's longest prompt plus its largest max_tokens.
Those two wastes are what the paged, continuous engine removes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from minifer.attention.layer import ContiguousKVCache
from minifer.models.llama import LlamaForCausalLM
from minifer.request import Request, RequestStatus
from minifer.sample.sampler import sample_sequences


@torch.inference_mode()
def run_static_batch(model: LlamaForCausalLM, batch: list[Request], tokenizer, pad_id: int = 0) -> int:
    """Generate every sequence of one padded batch to completion. Returns the number of decode steps."""
    cfg, device = model.config, model.lm_head.weight.device
    dtype = model.lm_head.weight.dtype
    b = len(batch)
    lens = torch.tensor([len(s.prompt_token_ids) for s in batch], device=device)
    p = int(lens.max())
    max_new = max(s.max_tokens for s in batch)
    cache = ContiguousKVCache(cfg.num_hidden_layers, b, cfg.num_key_value_heads, p + max_new, cfg.head_dim,
                              dtype, device)
    ids = torch.full((b, p), pad_id, dtype=torch.long, device=device)
    for i, s in enumerate(batch):
        ids[i, p - len(s.prompt_token_ids):] = torch.tensor(s.prompt_token_ids, device=device)
        s.status = RequestStatus.RUNNING
        s.metrics.first_scheduled_time = s.metrics.first_scheduled_time or time.perf_counter()
    pad = (p - lens)[:, None]
    slots = torch.arange(p, device=device)[None, :]
    valid = slots >= pad
    positions = (slots - pad).clamp(min=0)

    cache.begin_step(0, p, valid)
    hidden = model(ids.reshape(-1), positions.reshape(-1), cache)
    logits = model.compute_logits(hidden.view(b, p, -1)[:, -1])
    step = 0
    ones = torch.ones(b, 1, dtype=torch.bool, device=device)
    while True:
        # The penalties and min_tokens read each row's own tokens (the padding is not among them).
        result = sample_sequences(batch, logits)
        for i, s in enumerate(batch):
            if not s.is_finished:
                s.append_token(result.token_ids[i], result.sampled_logprob[i], result.logprobs[i], tokenizer)
        if all(s.is_finished for s in batch):
            return step
        nxt = torch.tensor(result.token_ids, device=device)
        cache.begin_step(p + step, 1, ones)
        # Rows that already finished keep stepping (the static-batching waste); their positions may run
        # past the model's limit, so clamp them — their outputs are ignored.
        positions = (lens + step).clamp(max=model.model.rotary.cos.shape[0] - 1)
        hidden = model(nxt, positions, cache)
        logits = model.compute_logits(hidden)
        step += 1


def generate_static(model: LlamaForCausalLM, seqs: list[Request], batch_size: int, tokenizer,
                    on_batch_done: Callable[[list[Request]], None] | None = None) -> None:
    """Run ``seqs`` in consecutive padded batches of ``batch_size``."""
    for start in range(0, len(seqs), batch_size):
        batch = seqs[start : start + batch_size]
        run_static_batch(model, batch, tokenizer)
        if on_batch_done is not None:
            on_batch_done(batch)

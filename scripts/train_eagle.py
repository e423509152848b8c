"""Train the EAGLE draft head (``minifer/models/llama_eagle.py``) on the shipped target's own features (chapter 04).

Why a script of its own: the head is trained *from* the bundled target, not with it, so the target is frozen
and run once. Recipe (seeded, fixed step budget, one command, a few tens of minutes on 2 CPU cores):

1. the TinyStories train split is tokenized as ``train_pair.py`` does (``<eot> story <eot> ...``) and cut into
   windows of ``seq_len + 1`` tokens; held-out windows come from ``heldout.txt`` (never trained on);
2. the target runs once over them and its last hidden states (post-norm: what its LM head reads) are kept in
   memory as the features ``f``;
3. the **draft vocabulary** (EAGLE-3's ``draft_vocab_size``): the ``--draft-vocab-size`` target tokens the target
   itself predicts most often (greedy) over the training windows; the head's own LM head covers those only,
   starting from the target's rows for them, and ``d2t`` maps its ids back;
4. the head learns to map ``[f_t, embed(x_{t+1})]`` to ``f_{t+1}``: a smooth-L1 loss on the feature and a
   distillation loss (cross-entropy against the target's own next-token distribution restricted to the draft
   vocabulary, as EAGLE-3 does, on the positions whose target argmax the draft vocabulary holds): what a draft
   needs is to *agree with the target*, not with the text;
5. **training-time test** (EAGLE-3's idea): at inference the head feeds itself for draft steps 2..k, reading its
   own predicted features, which drift from the target's. So each batch runs ``--passes`` forwards; pass ``s``
   reads pass ``s - 1``'s predictions and attends exactly what draft step ``s`` attends in the engine: real
   features up to ``s`` positions back, then its own predictions (``TTTAttention`` builds that mask);
6. the report records the held-out top-1 agreement with the target for each pass (draft position 1..k,
   teacher-forced tokens, self-fed features), the losses, wall time and hardware.

Data: the shipped head read 1600 windows (the first ~410k tokens of the train split); the first head read 400,
and its agreement on them (0.63) against held-out windows (0.52) said it had seen too little text. The shipped
head's shape (a 768-token draft vocabulary, a 256-wide MLP, 2000 steps) reads 0.077 of the target's weights per
token (the first heads: 0.151, the full 2048-token LM head a third of it) and agrees with the target more often
on held-out windows (0.649 / 0.639 / 0.634 per draft position, trained on the shipped target; the same recipe on the
target before its ``<|endoftext|>`` row was trained: 0.648 / 0.635 / 0.633, against the first heads' 0.610 / 0.600 / 0.596).

Usage::

    python scripts/train_eagle.py --out minifer/assets/models/tinystories-target-eagle   # the shipped head (~13 min: --threads 1 on one core of 2 busy shared cores, ~2 the features, ~11 the 2000 steps)
    python scripts/train_eagle.py --smoke --out /tmp/eagle                                 # seconds

``--eagle3`` (or ``--aux-layers 2,6,9``) trains EAGLE-3's fused head (``tinystories-target-eagle3``, ``speculative_config``
method ``"eagle3"``) with the same recipe: its first pass reads the inputs of the named target
layers, concatenated, through the head's ``combine`` map instead of the last hidden state (the feature noise scaled
to each layer's spread); the losses and the agreement are the same, on the target's last hidden state::

    python scripts/train_eagle.py --eagle3 --threads 1 --out minifer/assets/models/tinystories-target-eagle3

``--features FILE`` keeps the target's features (and its greedy-token counts) in FILE and reads them back on a
rerun: they depend only on the target and the windows, so a recipe change (the head's shape, its steps) need not
recompute them. The shipped head's run read them from the file an earlier run of the same windows wrote.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_pair import DATA, encode_stream, fixed_windows, hardware, read_stories

from minifer.attention.layer import causal_backend
from minifer.model_loader import build_model, load_tokenizer, resolve_model
from minifer.models.llama_eagle import EagleHead, eagle3_aux_layers


@dataclass
class Recipe:
    seq_len: int = 256
    train_windows: int = 1600  # ~410k tokens of target features (~420 MB in bf16); 400 left the head data-bound
    heldout_windows: int = 48
    batch_size: int = 4
    steps: int = 2000  # 5 passes over the windows; 1000 (the previous head's) left the loss still falling
    warmup: int = 30
    lr: float = 2e-3
    weight_decay: float = 0.0
    passes: int = 3  # training-time test: draft positions 1..passes
    draft_vocab_size: int = 768  # of the target's 2048: 95% of its greedy tokens on held-out windows
    intermediate_size: int = 256  # the head's MLP (the target's is 704): the largest part of its weights
    feature_noise: float = 0.1  # uniform noise on the real input features (EAGLE-1's augmentation), x feature std
    reg_weight: float = 1.0
    seed: int = 0
    aux_layers: tuple[int, ...] | None = None  # EAGLE-3's fusion: the target layers whose inputs the head reads


class TTTAttention:
    """Attention for ``passes`` stacked forwards over the same window (training-time test).

    Pass ``s`` (1-based) at position ``p`` plays draft step ``s`` of a proposal whose last real feature is at
    ``p - s + 1``: it attends pass 1's keys (real features) at positions ``<= p - s + 1`` and pass ``j``'s key at
    position ``p - s + j`` for ``j = 2..s`` (its own chain of predictions), as the engine's head cache holds."""

    def __init__(self, seq_len: int, device: torch.device) -> None:
        self.t, self.device = seq_len, device
        self.keys: list[tuple[torch.Tensor, torch.Tensor]] = []

    def begin_pass(self, s: int) -> None:
        self.s = s
        if s == 1:
            self.keys = []

    def mask(self) -> torch.Tensor:
        t, s = self.t, self.s
        p = torch.arange(t, device=self.device)[:, None]
        q = torch.arange(t, device=self.device)[None, :]
        parts = [q <= p - s + 1] + [q == p - s + j for j in range(2, s + 1)]
        return torch.cat(parts, dim=1)  # [T, s * T]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t, hq, d = self.t, q.shape[1], q.shape[2]
        b = q.shape[0] // t
        kb = k.view(b, t, -1, d).transpose(1, 2)
        vb = v.view(b, t, -1, d).transpose(1, 2)
        self.keys.append((kb, vb))
        keys = torch.cat([kk for kk, _ in self.keys], dim=2)
        values = torch.cat([vv for _, vv in self.keys], dim=2)
        qb = q.view(b, t, hq, d).transpose(1, 2)
        out = F.scaled_dot_product_attention(qb, keys, values, attn_mask=self.mask(), enable_gqa=True)
        return out.transpose(1, 2).reshape(b * t, hq, d)


@torch.inference_mode()
def target_features(target, windows: torch.Tensor, bs: int, log) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's post-norm last hidden state at every position of every window, ``[W, T+1, H]`` (bf16), how
    often the target's greedy token is each vocabulary id over them ``[V]`` (what the draft vocabulary ranks), and
    the inputs of the layers ``target.model.aux_hidden_state_layers`` names, concatenated ``[W, T+1, A*H]`` (empty
    when it names none)."""
    layers = target.model.aux_hidden_state_layers
    out = torch.empty(windows.shape[0], windows.shape[1], target.config.hidden_size, dtype=torch.bfloat16)
    aux = torch.empty(windows.shape[0], windows.shape[1], len(layers) * target.config.hidden_size, dtype=torch.bfloat16)
    counts = torch.zeros(target.lm_head.weight.shape[0], dtype=torch.long)
    t0 = time.time()
    for i in range(0, len(windows), bs):
        w = windows[i : i + bs]
        cache, positions = causal_backend(target, w.shape[0], w.shape[1])
        hidden = target(w.reshape(-1), positions, cache)
        counts += torch.bincount(target.lm_head(hidden).argmax(-1), minlength=len(counts))
        out[i : i + bs] = hidden.view(w.shape[0], w.shape[1], -1).to(torch.bfloat16)
        if layers:
            aux[i : i + bs] = torch.cat(target.model.aux_hidden_states, -1).view(w.shape[0], w.shape[1], -1)
        if (i // bs) % 20 == 0:
            log(f"features {i + len(w)}/{len(windows)} windows ({time.time() - t0:.0f}s)")
    return out, counts, aux


def draft_vocabulary(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` target ids the target predicts most often (ties: the lower id), sorted: EAGLE-3's ``d2t`` order."""
    if not 0 < size <= len(counts):
        raise ValueError(f"--draft-vocab-size must be in [1, {len(counts)}] (the target's vocabulary), got {size}")
    order = sorted(range(len(counts)), key=lambda i: (-int(counts[i]), i))
    return torch.tensor(sorted(order[:size]))


def run_passes(head: EagleHead, tokens: torch.Tensor, feats: torch.Tensor, passes: int, noise: float,
               gen: torch.Generator | None, aux: torch.Tensor | None = None):
    """All passes over a batch of windows. ``tokens`` ``[B, T+1]``, ``feats`` ``[B, T+1, H]`` (float). Yields, per
    pass ``s``, the head's predicted features ``[B, T-1, H]`` at positions ``0..T-2`` (predicting ``f[1..T-1]``) and
    the mask of rows that are real draft steps (position ``p >= s - 1``). A fused head's first pass reads ``aux``
    ``[B, T+1, A*H]`` (the target layers it fuses) through ``combine_hidden_states``; the noise is scaled to each
    layer's spread, since the residual stream grows with depth."""
    b, t1, h = feats.shape
    t = t1 - 1  # positions 0..T-1 hold (f_p, x_{p+1}); the last has no target to compare with, so T - 1 used
    n = t - 1
    attn = TTTAttention(n, feats.device)
    positions = torch.arange(n, device=feats.device).repeat(b)
    ids = tokens[:, 1 : n + 1].reshape(-1)
    inp = feats[:, :n] if aux is None else aux[:, :n]
    if noise and gen is not None:
        spread = feats.std() if aux is None else aux.unflatten(-1, (-1, h)).std(dim=(0, 1, 3)).repeat_interleave(h)
        inp = inp + (torch.rand(inp.shape, generator=gen) - 0.5) * 2 * noise * spread
    inp = head.combine_hidden_states(inp)
    for s in range(1, passes + 1):
        attn.begin_pass(s)
        out = head(inp.reshape(-1, h), ids, positions, attn).view(b, n, h)
        valid = torch.arange(n, device=feats.device) >= s - 1
        yield out, valid
        inp = torch.cat([out.new_zeros(b, 1, h), out[:, :-1]], dim=1)  # step s + 1 at p reads the guess for f_p


def pass_losses(head: EagleHead, target_lm_head, out: torch.Tensor, feats: torch.Tensor, valid: torch.Tensor,
                reg_weight: float):
    """Distillation cross-entropy against the target's distribution over the draft vocabulary (EAGLE-3: the
    target's logits at the draft ids, renormalised; rows whose target argmax the draft vocabulary misses carry no
    cross-entropy: nothing the head outputs could draft them), plus smooth-L1 on the features; and top-1
    agreement with the target (the draft token, mapped to its target id, equals the target's greedy token), over
    the valid rows."""
    n = out.shape[1]
    want = feats[:, 1 : n + 1][:, valid]
    got = out[:, valid]
    with torch.no_grad():
        target_logits = target_lm_head(want)
        greedy = target_logits.argmax(-1)
        p_target = F.softmax(target_logits[..., head.draft_ids], dim=-1)
        in_vocab = head.t2d[greedy].float()
    logits = head.draft_logits(got)
    ce = (-(p_target * F.log_softmax(logits, dim=-1)).sum(-1) * in_vocab).sum() / in_vocab.sum().clamp(min=1)
    reg = F.smooth_l1_loss(got, want)
    agree = (head.to_target(logits.argmax(-1)) == greedy).float().mean()
    return ce + reg_weight * reg, ce, agree


@torch.no_grad()
def heldout_agreement(head: EagleHead, target_lm_head, tokens: torch.Tensor, feats: torch.Tensor,
                      passes: int, aux: torch.Tensor | None = None) -> list[float]:
    head.eval()
    hits = [0.0] * passes
    count = [0] * passes
    for i in range(0, len(tokens), 8):
        f = feats[i : i + 8].float()
        a = None if aux is None else aux[i : i + 8].float()
        for s, (out, valid) in enumerate(run_passes(head, tokens[i : i + 8], f, passes, 0.0, None, a)):
            _, _, agree = pass_losses(head, target_lm_head, out, f, valid, 0.0)
            rows = int(valid.sum()) * len(f)
            hits[s] += float(agree) * rows
            count[s] += rows
    head.train()
    return [h / c for h, c in zip(hits, count)]


def all_features(target, train_w: torch.Tensor, held_w: torch.Tensor, aux_layers: tuple[int, ...] | None,
                 cache: Path | None, log) -> tuple:
    """The target's features of the train and held-out windows (``target_features``; the layers ``aux_layers``
    names too, else None), read from ``cache`` when it holds them, written there when it does not."""
    if cache is not None and cache.is_file():
        train_f, counts, held_f, held_counts, *auxes = torch.load(cache)
        train_a, held_a = auxes if auxes else (None, None)
        width = 0 if train_a is None else train_a.shape[-1]
        if width != len(aux_layers or ()) * train_f.shape[-1]:
            raise ValueError(f"{cache} holds other target layers than --aux-layers asks for: recompute them")
        log(f"features read from {cache}")
        return train_f, counts, held_f, held_counts, train_a, held_a
    target.model.aux_hidden_state_layers = aux_layers or ()
    train_f, counts, train_a = target_features(target, train_w, 16, log)
    held_f, held_counts, held_a = target_features(target, held_w, 16, log)
    if aux_layers is None:
        train_a = held_a = None
    if cache is not None:
        torch.save((train_f, counts, held_f, held_counts, train_a, held_a), cache)
    return train_f, counts, held_f, held_counts, train_a, held_a


def lr_at(step: int, r: Recipe) -> float:
    if step < r.warmup:
        return r.lr * (step + 1) / r.warmup
    return r.lr * 0.5 * (1 + math.cos(math.pi * (step - r.warmup) / max(1, r.steps - r.warmup)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="tinystories-target")
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="a few steps on a few windows")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--train-windows", type=int)
    ap.add_argument("--passes", type=int)
    ap.add_argument("--draft-vocab-size", type=int, help="target tokens the head can propose (EAGLE-3's draft_vocab_size)")
    ap.add_argument("--intermediate-size", type=int, help="the head's MLP width")
    ap.add_argument("--aux-layers", type=lambda v: tuple(int(i) for i in v.split(",")), metavar="I,J,K",
                    help="EAGLE-3's fusion: the target layers whose inputs the head reads (e.g. 2,6,9); "
                         "without it the head reads the last hidden state")
    ap.add_argument("--eagle3", action="store_true", help="--aux-layers EAGLE-3's default low, middle and high layers")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--features", type=Path, help="cache the target's features here (a rerun reads them back)")
    args = ap.parse_args()
    r = Recipe()
    if args.smoke:
        r = Recipe(seq_len=64, train_windows=16, heldout_windows=4, batch_size=4, steps=4, warmup=1)
    for name in ("steps", "train_windows", "passes", "draft_vocab_size", "intermediate_size", "aux_layers"):
        if getattr(args, name) is not None:
            setattr(r, name, getattr(args, name))
    torch.set_num_threads(args.threads)
    torch.manual_seed(r.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_file = open(out / "train.log", "w")
    t_start = time.time()

    def log(msg: str) -> None:
        line = f"[{time.time() - t_start:7.1f}s] {msg}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    path = resolve_model(args.target)
    target = build_model(path, load_format="auto", dtype=torch.float32, device=torch.device("cpu"))
    if args.eagle3:
        r.aux_layers = r.aux_layers or eagle3_aux_layers(target.config.num_hidden_layers)
    for p in target.parameters():
        p.requires_grad_(False)
    tok = load_tokenizer(path)
    train_stream = encode_stream(tok, read_stories(DATA / "train.txt"))
    held_stream = encode_stream(tok, read_stories(DATA / "heldout.txt"))
    train_w = fixed_windows(train_stream, r.seq_len, r.train_windows)
    held_w = fixed_windows(held_stream, r.seq_len, r.heldout_windows)
    log(f"recipe {asdict(r)}; {len(train_w)} train windows, {len(held_w)} held-out windows")
    train_f, counts, held_f, held_counts, train_a, held_a = all_features(target, train_w, held_w, r.aux_layers,
                                                                         args.features, log)
    t_features = time.time() - t_start
    vocab = draft_vocabulary(counts, r.draft_vocab_size)
    coverage = {"train": float(counts[vocab].sum() / counts.sum()), "heldout": float(held_counts[vocab].sum() /
                                                                                      held_counts.sum())}
    log(f"draft vocabulary: {len(vocab)} of {len(counts)} target ids, holding this share of the target's greedy "
        f"tokens: {coverage}")

    head = EagleHead(target, max_positions=r.seq_len + 1, draft_vocab=vocab, intermediate_size=r.intermediate_size,
                     aux_layers=r.aux_layers)
    lm_head = target.lm_head
    opt = torch.optim.AdamW(head.parameters(), lr=r.lr, weight_decay=r.weight_decay, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(r.seed)
    log(f"head: {sum(p.numel() for p in head.parameters())} trained parameters; "
        f"held-out agreement before training {heldout_agreement(head, lm_head, held_w, held_f, r.passes, held_a)}")
    for step in range(r.steps):
        idx = torch.randint(0, len(train_w), (r.batch_size,), generator=gen)
        tokens, feats = train_w[idx], train_f[idx].float()
        aux = None if train_a is None else train_a[idx].float()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, r)
        total, parts = 0.0, []
        for out_s, valid in run_passes(head, tokens, feats, r.passes, r.feature_noise, gen, aux):
            loss, ce, agree = pass_losses(head, lm_head, out_s, feats, valid, r.reg_weight)
            total = total + loss
            parts.append(f"{float(ce.detach()):.3f}/{float(agree):.2f}")
        opt.zero_grad(set_to_none=True)
        (total / r.passes).backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == r.steps - 1:
            log(f"step {step} lr {lr_at(step, r):.2e} loss {float(total.detach()) / r.passes:.3f} "
                f"ce/agree per pass {' '.join(parts)}")
    agreement = heldout_agreement(head, lm_head, held_w, held_f, r.passes, held_a)
    log(f"held-out top-1 agreement with the target per draft position: {[round(a, 4) for a in agreement]}")
    report = {
        "target": args.target,
        "recipe": asdict(r),
        "smoke": args.smoke,
        "train_tokens": int(train_w.numel() - len(train_w)),
        "heldout_tokens": int(held_w.numel() - len(held_w)),
        "heldout_top1_agreement_per_draft_position": agreement,
        "draft_vocab_size": len(vocab),
        "draft_vocab_coverage_of_target_greedy_tokens": coverage,
        "agreement_note": "teacher-forced tokens, self-fed features (pass s plays draft step s), greedy top-1 of "
                          "the head vs the target's at the same position",
        "feature_seconds": round(t_features, 1),
        "wall_seconds": round(time.time() - t_start, 1),
        "trained_parameters": sum(p.numel() for p in head.parameters()),
        "hardware": hardware(),
        "threads": args.threads,
    }
    head.save(out, {"target": args.target, "hidden_size": target.config.hidden_size, "num_hidden_layers": 1,
                    "vocab_size": len(counts), "draft_vocab_size": len(vocab), "intermediate_size": r.intermediate_size,
                    "training": "scripts/train_eagle.py"})
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"saved the head to {out} ({report['wall_seconds']}s)")


if __name__ == "__main__":
    main()

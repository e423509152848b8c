"""Train the course's bundled tokenizer and Llama model pair on TinyStories.

Why this script exists: no model hub is reachable on the course machines, yet every chapter needs a
*trained* target and draft (random weights make speculative acceptance and quantization quality
meaningless). The pair is trained once with this script and committed under
``minifer/assets/models/``; CI runs it only in ``--smoke`` mode to prove it still works.

Recipe (seeded, fixed step budgets, best checkpoint picked on a validation slice of the *training* file;
``data/tinystories/heldout.txt`` is never trained on and is only evaluated at the end):

1. a byte-level BPE tokenizer (HF ``tokenizers``, vocabulary 2048, ``<|endoftext|>`` as BOS/EOS);
2. the stories are tokenized and concatenated as ``<eot> story <eot> story ...`` so the models learn
   both how a story starts after ``<eot>`` and that it ends with one;
3. random windows of ``seq_len + 1`` tokens train a target (12 layers, 256 wide, GQA 8:2) with AdamW,
   warm-up then cosine decay, bf16 autocast and residual dropout (1.8M tokens for 9.5M parameters
   overfits within a few epochs without it; two dropout rates are tried and the better kept);
4. the draft (2 layers, 128 wide, tied embeddings) then trains on the same windows with half of its loss
   distilled from the target's next-token distribution: a draft is useful when it *agrees with the
   target*, and distillation raises that agreement (DistillSpec, Zhou et al. 2023);
5. every ``eval_every`` steps the validation loss is measured and the best weights kept; training stops
   after ``patience`` evaluations without improvement;
6. both are saved in HF format (bf16 safetensors) and a JSON report gives held-out/train losses, the
   draft's greedy agreement with the target, samples, wall time and hardware.

Usage::

    python scripts/train_pair.py --out minifer/assets/models             # the real run (GPU: minutes)
    python scripts/train_pair.py --smoke --out /tmp/pair                 # CI: a few steps on a CPU
    python scripts/train_pair.py --tokenizer minifer/assets/models/tinystories-target --out ...

The stages can also run separately (the GPU run trained the two target variants in parallel):
``--only tokenizer``, ``--only target --target-dropout 0.1``, ``--only draft --teacher DIR``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "tinystories"
EOT = "<|endoftext|>"
VOCAB_SIZE = 2048


@dataclass
class Shape:
    """The architecture of one model of the pair (Llama family)."""

    name: str
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    tie_word_embeddings: bool
    lr: float
    dropout: float = 0.0  # on each residual branch's output (attention and MLP); training only
    max_steps: int | None = None  # overrides the budget's (the small draft keeps improving for longer)


TARGET = Shape("tinystories-target", 12, 256, 704, 8, 2, False, 1.5e-3)
DRAFT = Shape("tinystories-draft", 2, 128, 384, 4, 2, True, 3e-3, max_steps=1600)
TARGET_DROPOUTS = (0.3, 0.4)  # swept; the variant with the lower validation loss is kept
MAX_GAP = 0.28  # a checkpoint counts only if validation minus train loss stays under this (no memorizing)
KD_WEIGHT = 0.5  # the draft learns half from the text, half from the target's distribution


@dataclass
class Budget:
    """Step budget shared by both models (smoke mode shrinks it to seconds)."""

    seq_len: int = 512
    batch_size: int = 64
    max_steps: int = 1000
    warmup: int = 100
    eval_every: int = 50
    patience: int = 5
    eval_windows: int = 200
    weight_decay: float = 0.1
    seed: int = 0


def read_stories(path: Path) -> list[str]:
    text = path.read_text(encoding="ascii")
    return [s.strip() for s in text.split(EOT) if s.strip()]


def train_tokenizer(stories: list[str], out_dir: Path) -> None:
    """Byte-level BPE with ``<|endoftext|>`` prepended to every encoded text (the model's BOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(stories, trainer=trainer)
    eot_id = tok.token_to_id(EOT)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, eot_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOT, eos_token=EOT, unk_token=None, pad_token=EOT,
        model_max_length=1024,
    )
    fast.save_pretrained(out_dir)


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def encode_stream(tok, stories: list[str]) -> torch.Tensor:
    """``<eot> s1 <eot> s2 ... <eot>`` as one long int32 tensor."""
    eot = tok.convert_tokens_to_ids(EOT)
    ids: list[int] = [eot]
    for s in stories:
        ids.extend(tok(s, add_special_tokens=False)["input_ids"])
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


def make_model(shape: Shape, tok, seq_len: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    eot = tok.convert_tokens_to_ids(EOT)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.hidden_size // shape.num_attention_heads,
        max_position_embeddings=2 * seq_len,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=shape.tie_word_embeddings,
        bos_token_id=eot,
        eos_token_id=eot,
        # No pad token: with pad_token_id = <eot>, nn.Embedding(padding_idx=<eot>) would never train the
        # embedding of the token that starts every prompt (BOS), leaving it at zero. Training windows are cut
        # from one continuous stream, so no batch holds padding and the loss has nothing to mask.
        pad_token_id=None,
        attention_bias=False,
        mlp_bias=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    if shape.dropout > 0:
        # transformers' Llama has no residual dropout; add it to each branch output (active in train()).
        def drop(module, inputs, output):
            if isinstance(output, tuple):
                return (F.dropout(output[0], shape.dropout, module.training), *output[1:])
            return F.dropout(output, shape.dropout, module.training)

        for layer in model.model.layers:
            layer.self_attn.register_forward_hook(drop)
            layer.mlp.register_forward_hook(drop)
    return model


def batches(stream: torch.Tensor, seq_len: int, batch_size: int, gen: torch.Generator):
    hi = len(stream) - seq_len - 1
    while True:
        starts = torch.randint(0, hi, (batch_size,), generator=gen)
        idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
        yield stream[idx]


def fixed_windows(stream: torch.Tensor, seq_len: int, limit: int) -> torch.Tensor:
    """Non-overlapping windows from the start of a stream: the evaluation set (deterministic)."""
    n = min(limit, (len(stream) - 1) // seq_len)
    return torch.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])


@torch.no_grad()
def mean_loss(model, windows: torch.Tensor, device: str, bs: int = 32) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), bs):
        w = windows[i : i + bs].to(device)
        with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16):
            logits = model(input_ids=w[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += w[:, 1:].numel()
    model.train()
    return total / count


def lr_at(step: int, budget: Budget, peak: float) -> float:
    if step < budget.warmup:
        return peak * (step + 1) / budget.warmup
    t = (step - budget.warmup) / max(1, budget.max_steps - budget.warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def train_one(shape: Shape, tok, train: torch.Tensor, val: torch.Tensor, budget: Budget, device: str, log,
              teacher=None) -> tuple:
    if shape.max_steps and not budget.max_steps < 100:  # smoke budgets stay tiny
        budget = Budget(**{**asdict(budget), "max_steps": shape.max_steps})
    model = make_model(shape, tok, budget.seq_len).to(device)
    nparams = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": budget.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=shape.lr, betas=(0.9, 0.95), fused=device.startswith("cuda"),
    )
    gen = torch.Generator().manual_seed(budget.seed)
    val_windows = fixed_windows(val, budget.seq_len, budget.eval_windows)
    train_windows = fixed_windows(train, budget.seq_len, budget.eval_windows)
    best = (float("inf"), None, -1)
    history = []
    bad = 0
    t0 = time.time()
    tokens = 0
    for step, batch in enumerate(batches(train, budget.seq_len, budget.batch_size, gen)):
        if step >= budget.max_steps:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, budget, shape.lr)
        batch = batch.to(device, non_blocking=True)
        with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16):
            logits = model(input_ids=batch[:, :-1]).logits
        flat = logits.float().reshape(-1, logits.shape[-1])
        loss = F.cross_entropy(flat, batch[:, 1:].reshape(-1))
        if teacher is not None:
            with torch.no_grad(), torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16):
                t_logits = teacher(input_ids=batch[:, :-1]).logits
            t_logp = F.log_softmax(t_logits.float().reshape(-1, t_logits.shape[-1]), -1)
            kd = F.kl_div(F.log_softmax(flat, -1), t_logp, log_target=True, reduction="batchmean")
            loss = (1 - KD_WEIGHT) * loss + KD_WEIGHT * kd
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += batch[:, 1:].numel()
        if (step + 1) % budget.eval_every == 0 or step + 1 == budget.max_steps:
            v = mean_loss(model, val_windows, device)
            tr = mean_loss(model, train_windows, device)
            history.append({"step": step + 1, "train_batch_loss": round(loss.item(), 4), "val_loss": round(v, 4),
                            "train_loss": round(tr, 4), "seconds": round(time.time() - t0, 1)})
            log(f"{shape.name} step {step + 1} loss {loss.item():.3f} train {tr:.3f} val {v:.3f} "
                f"({tokens / (time.time() - t0):,.0f} tok/s)")
            if v - tr > MAX_GAP and best[1] is not None:
                log(f"{shape.name}: stopping, validation - train = {v - tr:.3f} > {MAX_GAP} (memorizing)")
                break
            if v < best[0] - 1e-4:
                best = (v, {k: t.detach().cpu().clone() for k, t in model.state_dict().items()}, step + 1)
                bad = 0
            else:
                bad += 1
                if bad >= budget.patience:
                    log(f"{shape.name}: stopping, no improvement in {bad} evaluations")
                    break
    model.load_state_dict(best[1])
    info = {"params": nparams, "best_step": best[2], "best_val_loss": round(best[0], 4),
            "train_seconds": round(time.time() - t0, 1), "tokens_seen": tokens,
            "tokens_per_second": round(tokens / (time.time() - t0)), "history": history, **asdict(shape)}
    return model, info


@torch.no_grad()
def greedy(model, ids: torch.Tensor, n: int, eot: int) -> list[int]:
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=eot, pad_token_id=eot)
    return out[0, ids.shape[1]:].tolist()


@torch.no_grad()
def draft_agreement(target, draft, prompts: list[torch.Tensor], k: int, n_new: int, device: str) -> float:
    """Mean number of the draft's k greedy proposals the target would accept (greedy verification).

    Along the target's own greedy continuation of each prompt, at every position the draft proposes k
    tokens greedily; the accepted count is the length of the prefix that equals the target's tokens.
    """
    accepted = []
    for p in prompts:
        p = p.to(device)
        cont = target.generate(p[None], max_new_tokens=n_new, do_sample=False, pad_token_id=0)[0]
        base = p.numel()
        for t in range(base, cont.numel() - k):
            prop = draft.generate(cont[None, :t], max_new_tokens=k, do_sample=False, pad_token_id=0,
                                  eos_token_id=None)[0, t:]
            ref = cont[t : t + k]
            m = 0
            while m < min(len(prop), len(ref)) and prop[m] == ref[m]:
                m += 1
            accepted.append(m)
    return sum(accepted) / max(1, len(accepted))


def hardware() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
            "cpu_count": __import__("os").cpu_count()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def save_model(model, tok, dest: Path, info: dict) -> None:
    """HF layout: bf16 safetensors, config, generation config, tokenizer, and the training record."""
    eot = tok.convert_tokens_to_ids(EOT)
    if dest.exists():
        shutil.rmtree(dest)
    model.to(torch.bfloat16).save_pretrained(dest, safe_serialization=True)
    model.to(torch.float32)
    model.generation_config.bos_token_id = eot
    model.generation_config.eos_token_id = eot
    model.generation_config.pad_token_id = eot
    model.generation_config.save_pretrained(dest)
    tok.save_pretrained(dest)
    # transformers 5 records its own class name; the generic one loads in 4.x and 5.x alike.
    tc = dest / "tokenizer_config.json"
    tc.write_text(json.dumps({**json.loads(tc.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2))
    (dest / "training.json").write_text(json.dumps(info, indent=2))


def evaluate(model, info: dict, train: torch.Tensor, held: torch.Tensor, budget: Budget, device: str) -> None:
    held_w = fixed_windows(held, budget.seq_len, 10_000)
    train_w = fixed_windows(train, budget.seq_len, len(held_w))
    info["heldout_loss"] = round(mean_loss(model, held_w, device), 4)
    info["train_loss"] = round(mean_loss(model, train_w, device), 4)
    info["generalization_gap"] = round(info["heldout_loss"] - info["train_loss"], 4)


def load_hf(path: Path, device: str):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder that receives tinystories-{target,draft}/")
    ap.add_argument("--tokenizer", type=Path, help="reuse this tokenizer folder instead of training one")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="a few steps on a slice of the data (CI)")
    ap.add_argument("--only", choices=["all", "tokenizer", "target", "draft"], default="all")
    ap.add_argument("--target-dropout", type=float, nargs="+", default=list(TARGET_DROPOUTS))
    ap.add_argument("--teacher", type=Path, help="with --only draft: the trained target folder")
    args = ap.parse_args()

    torch.manual_seed(0)
    random.seed(0)
    budget = Budget()
    stories = read_stories(DATA / "train.txt")
    heldout = read_stories(DATA / "heldout.txt")
    n_val = max(1, len(stories) // 50)
    train_stories, val_stories = stories[:-n_val], stories[-n_val:]
    if args.smoke:
        budget = Budget(seq_len=64, batch_size=8, max_steps=6, warmup=2, eval_every=3, patience=2, eval_windows=4)
        train_stories, val_stories, heldout = train_stories[:200], val_stories[:20], heldout[:20]

    t_start = time.time()
    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    args.out.mkdir(parents=True, exist_ok=True)
    tok_dir = args.out / "_tokenizer"
    if args.tokenizer:
        tok = load_tokenizer(args.tokenizer)
    else:
        train_tokenizer(train_stories, tok_dir)
        tok = load_tokenizer(tok_dir)
    if args.only == "tokenizer":
        return
    eot = tok.convert_tokens_to_ids(EOT)
    train = encode_stream(tok, train_stories)
    val = encode_stream(tok, val_stories)
    held = encode_stream(tok, heldout)
    log(f"tokens: train {len(train):,}  val {len(val):,}  heldout {len(held):,}  "
        f"({sum(map(len, train_stories)) / len(train):.2f} chars/token)")
    common = {"budget": asdict(budget), "hardware": hardware(), "device": args.device,
              "data": {"train_tokens": len(train), "val_tokens": len(val), "heldout_tokens": len(held)}}

    target_dir = args.out / TARGET.name
    if args.only in ("all", "target"):
        best = None
        for p in args.target_dropout:
            shape = Shape(**{**asdict(TARGET), "dropout": p})
            model, info = train_one(shape, tok, train, val, budget, args.device, log)
            if best is None or info["best_val_loss"] < best[1]["best_val_loss"]:
                best = (model, info)
        model, info = best
        evaluate(model, info, train, held, budget, args.device)
        info.update(common, log=list(lines))
        log(f"{TARGET.name}: dropout {info['dropout']} heldout {info['heldout_loss']} train {info['train_loss']}")
        save_model(model, tok, target_dir, info)
        if args.only == "target":
            return

    teacher = load_hf(args.teacher or target_dir, args.device)
    lines.clear()
    draft, info = train_one(DRAFT, tok, train, val, budget, args.device, log, teacher=teacher)
    evaluate(draft, info, train, held, budget, args.device)
    info.update(common, log=list(lines), kd_weight=KD_WEIGHT)
    log(f"{DRAFT.name}: heldout {info['heldout_loss']} train {info['train_loss']}")
    save_model(draft, tok, args.out / DRAFT.name, info)

    target, draft = teacher, draft.eval()
    report = {"target": json.loads((Path(args.teacher or target_dir) / "training.json").read_text()), "draft": info}
    prompts = [tok(s[:60].rsplit(" ", 1)[0], return_tensors="pt")["input_ids"][0] for s in heldout[:16]]
    n_new = 8 if args.smoke else 48
    report["draft_agreement_k4"] = round(draft_agreement(target, draft, prompts[: 2 if args.smoke else 16], 4,
                                                         n_new, args.device), 3)
    samples = []
    for text in ["Once upon a time", "Tom and his dog", "The little bird was sad because"]:
        ids = tok(text, return_tensors="pt")["input_ids"].to(args.device)
        out = greedy(target, ids, 16 if args.smoke else 400, eot)
        samples.append({"prompt": text, "completion": tok.decode(out, skip_special_tokens=False),
                        "ends_with_eot": bool(out and out[-1] == eot), "new_tokens": len(out)})
    report["samples"] = samples
    report["summary"] = {
        "target_heldout_loss": report["target"]["heldout_loss"], "draft_heldout_loss": info["heldout_loss"],
        "target_minus_draft": round(report["target"]["heldout_loss"] - info["heldout_loss"], 4),
        "target_gap": report["target"]["generalization_gap"], "draft_agreement_k4": report["draft_agreement_k4"],
    }
    log(json.dumps(report["summary"]))
    (args.out / "train_report.json").write_text(json.dumps(report, indent=2))
    if tok_dir.exists():
        shutil.rmtree(tok_dir)


if __name__ == "__main__":
    main()

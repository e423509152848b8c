"""Quality, measured: perplexity, greedy agreement with a reference model, and a second domain (chapter 05).

A quantized model is a different model; how different is a property of the *workload*, so it is measured
on text, never assumed.

**Perplexity** is ``exp`` of the mean negative log-likelihood per token, *token-weighted* over the whole
set (every predicted token counts once, whatever text it came from; not a mean of per-text
perplexities). Texts are framed as the bundled models were trained (``scripts/train_pair.py``): one stream
``<eot> t1 <eot> t2 <eot> ...``, cut from its start into non-overlapping windows of ``max_len + 1`` tokens
(consecutive windows share one token); a window predicts its last ``max_len`` tokens, each from the tokens
before it in the window. All windows have the same length, so they run in batches with no padding, through
the model's own forward with a causal attention backend (``causal_forward``). ``max_tokens`` keeps windows
spread evenly over the whole stream, a deterministic subsample.

**Agreement** between a model A and a reference B, two definitions:

- ``greedy_agreement`` (teacher forcing): on the same windows, the fraction of positions where A's most
  likely next token equals B's. Both read the same text, so one early disagreement does not spill into
  later positions: it is a per-position measure of how often quantization flips the top token.
- ``generation_agreement`` (free running): both continue the same prompts greedily for ``n_tokens``; for
  each prompt, the fraction of the ``n_tokens`` generated before the first token where they differ (1.0 =
  identical output), averaged over prompts. After a divergence the two texts go different ways, so
  positions beyond it are not compared. This is what a user sees.

**Second domain.** The bundled model learned children's stories with a 2048-token BPE trained on them.
``stdlib_texts`` reads a fixed list of Python standard-library modules (from the module body's first
``import``/``def``/``class`` line, truncated to ``max_chars``): code the model never saw, which its tokenizer
splits into many short tokens. The absolute perplexity there is poor, and that is the point: the *change*
quantization causes is measured on a workload unlike the training data, and need not match the change on
stories. (The files differ slightly between Python versions; results record the version.)
"""

from __future__ import annotations

import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from minifer.attention.layer import ContiguousKVCache, causal_backend

DATA = Path(__file__).resolve().parents[1] / "data" / "tinystories"
HELDOUT, TRAIN = DATA / "heldout.txt", DATA / "train.txt"
EOT = "<|endoftext|>"
STDLIB_FILES = ("textwrap.py", "heapq.py", "bisect.py", "fractions.py", "statistics.py", "shlex.py", "string.py",
                "graphlib.py", "colorsys.py", "fnmatch.py", "glob.py", "queue.py")


# --- text --------------------------------------------------------------------------------------------


def read_stories(path: str | Path = HELDOUT) -> list[str]:
    """The stories of a TinyStories split (``<|endoftext|>``-separated), stripped as in training."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the TinyStories splits ship in data/tinystories of a "
                                f"minifer checkout")
    return [s.strip() for s in path.read_text(encoding="ascii").split(EOT) if s.strip()]


def stdlib_texts(files: Sequence[str] = STDLIB_FILES, max_chars: int = 4000) -> list[str]:
    """Python standard-library sources: each file from its first top-level ``import``, ``from``, ``def`` or
    ``class`` line (the module docstring before it is prose, not code), cut to ``max_chars`` characters."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for name in files:
        lines = (root / name).read_text(encoding="utf-8").splitlines(keepends=True)
        start = next((i for i, line in enumerate(lines) if line.startswith(("import ", "from ", "def ", "class "))), 0)
        out.append("".join(lines[start:])[:max_chars])
    return out


def token_stream(tokenizer, texts: Sequence[str]) -> torch.Tensor:
    """``<eot> t1 <eot> t2 ... <eot>`` as one 1-D tensor of token ids (the training framing)."""
    eot = tokenizer.convert_tokens_to_ids(EOT)
    if eot is None or eot == tokenizer.unk_token_id:
        eot = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    ids = [eot]
    for t in texts:
        ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


def calibration_data(tokenizer, num_sequences: int = 32, seq_len: int = 512, seed: int = 0,
                     path: str | Path = TRAIN) -> torch.Tensor:
    """``[num_sequences, seq_len]`` token ids: stories of ``path`` (the training split) in a seeded random
    order, framed as in training (``<eot> s1 <eot> s2 ...``) and cut into consecutive windows."""
    stories = read_stories(path)
    order = torch.randperm(len(stories), generator=torch.Generator().manual_seed(seed)).tolist()
    need, picked, have = num_sequences * seq_len, [], 0
    for i in order:
        picked.append(stories[i])
        have += len(stories[i]) // 4  # stories run ~3.7 characters a token: tokenize once there are enough
        if have >= need:
            stream = token_stream(tokenizer, picked)
            if len(stream) >= need:
                return stream[:need].view(num_sequences, seq_len)
    raise ValueError(f"{path} holds fewer than {need} tokens")


def token_windows(stream: torch.Tensor, max_len: int = 512, max_tokens: int | None = None) -> torch.Tensor:
    """Non-overlapping windows ``[n, max_len + 1]`` of a stream; with ``max_tokens``, ``ceil(max_tokens /
    max_len)`` of them spread evenly from the first to the last."""
    n = (len(stream) - 1) // max_len
    if n < 1:
        raise ValueError(f"{len(stream)} tokens do not fill one window of {max_len} + 1")
    idx = torch.arange(n)
    if max_tokens is not None and max_tokens < n * max_len:
        idx = torch.linspace(0, n - 1, -(-max_tokens // max_len)).round().long()
    return torch.stack([stream[i * max_len : i * max_len + max_len + 1] for i in idx.tolist()])


def heldout_windows(tokenizer, max_len: int = 512, max_tokens: int | None = None) -> torch.Tensor:
    return token_windows(token_stream(tokenizer, read_stories(HELDOUT)), max_len, max_tokens)


def stdlib_windows(tokenizer, max_len: int = 512, max_tokens: int | None = None, **kw) -> torch.Tensor:
    return token_windows(token_stream(tokenizer, stdlib_texts(**kw)), max_len, max_tokens)


# --- forward passes -----------------------------------------------------------------------------------


def causal_forward(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Final hidden states ``[B * T, hidden]`` of ``ids`` ``[B, T]``, each row a sequence from position 0."""
    attn, positions = causal_backend(model, *ids.shape)
    return model(ids.reshape(-1), positions, attn)


@dataclass
class WindowScores:
    """Per-position results of a model on windows ``[n, L + 1]``: the NLL of each true next token and the
    model's most likely next token, both ``[n, L]``."""

    nll: torch.Tensor
    argmax: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.nll.numel()

    @property
    def mean_nll(self) -> float:
        return float(self.nll.double().mean())

    @property
    def perplexity(self) -> float:
        return float(torch.exp(self.nll.double().mean()))

    def agreement(self, other: WindowScores) -> float:
        """Teacher-forced greedy agreement: share of positions where both predict the same top token."""
        if self.argmax.shape != other.argmax.shape:
            raise ValueError(f"scores of different windows: {tuple(self.argmax.shape)} vs {tuple(other.argmax.shape)}")
        return float((self.argmax == other.argmax).double().mean())


@torch.inference_mode()
def score_windows(model: nn.Module, windows: torch.Tensor, batch_size: int = 8) -> WindowScores:
    """Run every window (``batch_size`` at a time) and keep each position's NLL and argmax."""
    device = model.lm_head.weight.device
    nll, top = [], []
    for i in range(0, len(windows), batch_size):
        w = windows[i : i + batch_size].to(device)
        inp, tgt = w[:, :-1], w[:, 1:]
        logits = model.compute_logits(causal_forward(model, inp)).float()
        nll.append(F.cross_entropy(logits, tgt.reshape(-1), reduction="none").view_as(tgt).cpu())
        top.append(logits.argmax(-1).view_as(tgt).cpu())
    return WindowScores(torch.cat(nll), torch.cat(top))


def _model_and_tokenizer(llm_or_model, tokenizer):
    if isinstance(llm_or_model, nn.Module):
        return llm_or_model, tokenizer
    return llm_or_model.model, tokenizer if tokenizer is not None else llm_or_model.tokenizer


def _windows(texts, tokenizer, max_len: int, max_tokens: int | None) -> torch.Tensor:
    if isinstance(texts, torch.Tensor):
        return texts
    if tokenizer is None:
        raise ValueError("texts need a tokenizer: pass an LLM, tokenizer=..., or token windows [n, max_len + 1]")
    return token_windows(token_stream(tokenizer, list(texts)), max_len, max_tokens)


def perplexity(llm_or_model, texts: Sequence[str] | torch.Tensor, *, tokenizer=None, max_len: int = 512,
               max_tokens: int | None = None, batch_size: int = 8) -> float:
    """Token-weighted perplexity of an ``LLM`` (or a model plus ``tokenizer``) on ``texts``, or on token
    windows ``[n, max_len + 1]`` made by ``token_windows``."""
    model, tok = _model_and_tokenizer(llm_or_model, tokenizer)
    return score_windows(model, _windows(texts, tok, max_len, max_tokens), batch_size).perplexity


def engine_perplexity(llm, texts: Sequence[str] | torch.Tensor, *, max_len: int = 512,
                      max_tokens: int | None = None) -> float:
    """The same perplexity through the serving engine: every window is a request with ``prompt_logprobs=0`` and
    one output token, continuously batched over the paged cache (chunked prefill, quantized weights and KV cache
    included), and the log-probabilities the engine reports are averaged. This is how evaluation harnesses
    score a model served by vLLM (lm-evaluation-harness's loglikelihood requests); it should agree with
    :func:`perplexity` on the same windows up to float rounding, which chapter 05 checks."""
    from minifer import SamplingParams

    windows = _windows(texts, llm.tokenizer, max_len, max_tokens)
    if windows.shape[1] + 1 > llm.max_model_len:
        raise ValueError(f"engine_perplexity sends each window of {windows.shape[1]} tokens as a prompt with one "
                         f"output token: it needs max_len + 2 <= max_model_len={llm.max_model_len}; use a smaller "
                         f"max_len")
    outs = llm.generate([{"prompt_token_ids": w.tolist()} for w in windows],
                        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    logps = [entry[t].logprob for o in outs for entry, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
    return float(torch.exp(-torch.tensor(logps, dtype=torch.float64).mean()))


def served_perplexity(base_url: str, model: str, windows: torch.Tensor, timeout: float = 600.0) -> float:
    """The same perplexity from any OpenAI-compatible server (minifer's ``serve``, or vLLM's): the windows go as
    one ``/v1/completions`` request, each a prompt of token ids, with ``echo=true, max_tokens=0, logprobs=0``,
    which returns every prompt token's log-probability given those before it (the first has none). This is how
    a harness scores a model it reaches only over HTTP (lm-evaluation-harness's ``local-completions``)."""
    import json
    import urllib.request

    body = {"model": model, "prompt": windows.tolist(), "max_tokens": 0, "echo": True, "logprobs": 0,
            "temperature": 0}
    request = urllib.request.Request(base_url.rstrip("/") + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        choices = json.loads(r.read())["choices"]
    logps = [lp for c in choices for lp in c["logprobs"]["token_logprobs"][1:]]
    return float(torch.exp(-torch.tensor(logps, dtype=torch.float64).mean()))


def greedy_agreement(model_a, model_b, texts: Sequence[str] | torch.Tensor, *, tokenizer=None, max_len: int = 512,
                     max_tokens: int | None = None, batch_size: int = 8) -> float:
    """Teacher-forced greedy agreement of two models (``LLM``s or models) on the same text (module docstring)."""
    a, tok = _model_and_tokenizer(model_a, tokenizer)
    b, tok = _model_and_tokenizer(model_b, tok)
    windows = _windows(texts, tok, max_len, max_tokens)
    return score_windows(a, windows, batch_size).agreement(score_windows(b, windows, batch_size))


@torch.inference_mode()
def greedy_continuations(model: nn.Module, prompts: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Greedy continuations ``[B, n_tokens]`` of equal-length prompts ``[B, P]``, ignoring EOS: a prefill,
    then one token per row per step through a contiguous KV cache."""
    cfg, w = model.config, model.lm_head.weight
    b, p = prompts.shape
    cache = ContiguousKVCache(cfg.num_hidden_layers, b, cfg.num_key_value_heads, p + n_tokens, cfg.head_dim,
                              w.dtype, w.device)
    cur, start, out = prompts.to(w.device), 0, []
    for _ in range(n_tokens):
        t = cur.shape[1]
        cache.begin_step(start, t, torch.ones(b, t, dtype=torch.bool, device=w.device))
        hidden = model(cur.reshape(-1), torch.arange(start, start + t, device=w.device).repeat(b), cache)
        cur = model.compute_logits(hidden.view(b, t, -1)[:, -1]).argmax(-1, keepdim=True)
        start += t
        out.append(cur)
    return torch.cat(out, dim=1).cpu()


def generation_agreement(model_a, model_b, prompts: torch.Tensor, n_tokens: int = 32) -> float:
    """Mean over prompts of the fraction of ``n_tokens`` greedy tokens generated before A and B first differ."""
    a, _ = _model_and_tokenizer(model_a, None)
    b, _ = _model_and_tokenizer(model_b, None)
    return prefix_agreement(greedy_continuations(a, prompts, n_tokens), greedy_continuations(b, prompts, n_tokens))


def prefix_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of the fraction of the columns of ``a`` and ``b`` ``[B, n]`` before their first difference."""
    same = (a == b).long().cumprod(dim=1)
    return float(same.sum(dim=1).double().mean() / a.shape[1])


def heldout_prompts(tokenizer, n: int = 8, length: int = 12) -> torch.Tensor:
    """The first ``length`` tokens (``<eot>`` first) of the first ``n`` held-out stories long enough."""
    rows = [token_stream(tokenizer, [s])[:length] for s in read_stories(HELDOUT)]
    rows = [r for r in rows if len(r) == length][:n]
    return torch.stack(rows)

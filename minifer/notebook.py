"""Helpers for the course notebooks: which models to run, comparisons, plots and widgets.

The notebooks teach with prose, a few calls and their results; the code that loads, compares, measures
and draws lives here (and in ``minifer.bench``) so that it is typed, tested and shared between chapters,
and a notebook cell stays short enough to read.

One switch chooses the hardware story: ``choose_models()`` returns the bundled TinyStories pair (the CPU
track, the default everywhere) unless ``MINIFER_TRACK=gpu`` asks for the GPU track, a real Qwen3 pair on a
CUDA GPU, which downloads a few GB and says so first; ``MINIFER_TARGET`` / ``MINIFER_DRAFT`` override either.
Every notebook cell works with both.
"""

from __future__ import annotations

import inspect
import math
import os
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from minifer.sampling import BeamSearchParams, SamplingParams, process_logits

if TYPE_CHECKING:  # imported lazily at run time: matplotlib and ipywidgets are course extras
    from matplotlib.figure import Figure

    from minifer.bench.roofline import Ceilings, Hardware, StepTiming
    from minifer.engine.llm import LLM
    from minifer.outputs import CompletionOutput

BUNDLED_PAIR = ("tinystories-target", "tinystories-draft")
GPU_PAIR = ("Qwen/Qwen3-1.7B", "Qwen/Qwen3-0.6B")
TRACK_ENV = "MINIFER_TRACK"  # "gpu" opts into the GPU track; anything else (or unset) is the CPU track

# --- which models ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelPair:
    """The target model a chapter studies and the draft model speculative decoding pairs with it."""

    target: str
    draft: str
    device: str
    reason: str

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    def load(self, which: str = "target", **kwargs: Any) -> "LLM":
        """``LLM`` for the target (or ``which="draft"``) on this pair's device; ``kwargs`` go to ``LLM``.

        On a GPU each engine's KV cache is held to ``minifer.gpu_plan.GPU_KV_CACHE_BYTES`` (at most the
        blocks a chapter asks for): the engine's own default takes 90% of the free memory, which left
        nothing for the next model a chapter loads."""
        from minifer import LLM

        name = {"target": self.target, "draft": self.draft}[which]
        kwargs.setdefault("device", self.device)
        if str(kwargs["device"]).startswith("cuda"):
            kwargs["num_kv_blocks"] = gpu_kv_blocks(name, kwargs)
        return LLM(name, **kwargs)

    def __str__(self) -> str:
        return f"target={self.target}  draft={self.draft}  device={self.device}  ({self.reason})"


def gpu_kv_blocks(model: str, llm_kwargs: Mapping[str, Any]) -> int:
    """The KV blocks an engine of ``model`` gets on the GPU track (``minifer.gpu_plan``): what
    ``GPU_KV_CACHE_BYTES`` holds in the engine's dtype and cache format, at most ``num_kv_blocks`` if given."""
    from minifer.engine.llm import resolve_dtype
    from minifer.gpu_plan import GPU_KV_CACHE_BYTES, kv_blocks_within
    from minifer.loader import load_config, resolve_model

    def config(name: str) -> Any:
        return load_config(resolve_model(name, need_weights=False))  # config.json only: no weights fetched here

    dtype = resolve_dtype(llm_kwargs.get("dtype", "auto"), torch.device(llm_kwargs.get("device", "cuda")))
    spec = llm_kwargs.get("speculative_config") or {}
    draft = config(spec["model"]) if spec.get("method") == "draft_model" and spec.get("model") else None
    return kv_blocks_within(config(model), GPU_KV_CACHE_BYTES, dtype.itemsize, llm_kwargs.get("block_size", 16),
                            llm_kwargs.get("kv_cache_dtype", "auto"), llm_kwargs.get("num_kv_blocks"), draft)


def gpu_track_download_note(pair: Sequence[str] = GPU_PAIR) -> str:
    """What the GPU track downloads from the Hugging Face Hub, said before it does: each hub model not yet in
    the local cache and its weights' size (parameters x 2 bytes, from the shipped config.json)."""
    from minifer.config import ModelConfig
    from minifer.loader import SHIPPED_CONFIGS

    parts = []
    for repo in dict.fromkeys(pair):
        if repo not in SHIPPED_CONFIGS:
            continue
        if _in_hf_cache(repo):
            parts.append(f"{repo} (cached)")
        else:
            gb = ModelConfig.from_file(SHIPPED_CONFIGS[repo]).num_parameters() * 2 / 1e9
            parts.append(f"{repo} (~{gb:.1f} GB)")
    return "downloads " + ", ".join(parts) if parts else "nothing to download"


def hub_reachable(timeout: float = 2.0) -> bool:
    """Whether huggingface.co answers a TCP connection within ``timeout`` seconds (False when
    ``HF_HUB_OFFLINE`` is set). A short socket probe, so an offline machine is not held up by retries."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    try:
        with socket.create_connection(("huggingface.co", 443), timeout=timeout):
            return True
    except OSError:
        return False


def _in_hf_cache(repo_id: str) -> bool:
    """Whether a hub checkpoint's config is already in the local Hugging Face cache (usable offline)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # noqa: BLE001 - any failure just means "not cached"
        return False


def choose_models(env: Mapping[str, str] | None = None, *, chapter: str | None = None) -> ModelPair:
    """The one setting that switches a notebook between the CPU and the GPU track.

    - ``MINIFER_TARGET`` / ``MINIFER_DRAFT`` (bundled names, local folders or hub ids) win when set.
    - The CPU track is the default, GPU or not: the bundled TinyStories pair (9.5M and 0.66M parameters),
      which runs in seconds on a laptop CPU, needs no download, and gives the numbers the stored outputs show.
    - ``MINIFER_TRACK=gpu`` on a CUDA machine whose Hub is reachable (or which has them cached): Qwen3-1.7B
      with Qwen3-0.6B as draft, the sizes where memory bandwidth, batching and speculation behave as in
      production. Opt-in because it downloads about 4.6 GB (the reason says what, before any download) and
      needs a GPU of 16 GB; with ``chapter`` (``"00"``...) the reason also gives that chapter's planned peak
      GPU memory (``minifer.gpu_plan``).
    """
    env = os.environ if env is None else env
    cuda = torch.cuda.is_available()
    gpu_track = env.get(TRACK_ENV, "").strip().lower() == "gpu"
    device = "cuda" if cuda and gpu_track else "cpu"
    target, draft = env.get("MINIFER_TARGET"), env.get("MINIFER_DRAFT")
    if target or draft:
        default = BUNDLED_PAIR
        if device == "cuda" and all(_in_hf_cache(r) for r in GPU_PAIR):
            default = GPU_PAIR
        pair = (target or default[0], draft or default[1])
        return ModelPair(*pair, device, f"set by MINIFER_TARGET/MINIFER_DRAFT; {gpu_track_download_note(pair)}")
    if not cuda:
        why = f"{TRACK_ENV}=gpu, but " if gpu_track else ""
        return ModelPair(*BUNDLED_PAIR, "cpu", f"{why}no CUDA GPU: the bundled TinyStories pair")
    if not gpu_track:
        return ModelPair(*BUNDLED_PAIR, "cpu", f"the CPU track; {TRACK_ENV}=gpu for the GPU track, which "
                                               f"{gpu_track_download_note()}")
    if all(_in_hf_cache(r) for r in GPU_PAIR) or hub_reachable():
        need = ""
        if chapter is not None:
            from minifer.gpu_plan import gpu_track_needs

            need = f"; chapter {chapter} plans {gpu_track_needs()[chapter] / 2**30:.1f} GiB of GPU memory at its peak"
        return ModelPair(*GPU_PAIR, device, f"the GPU track ({TRACK_ENV}=gpu): {gpu_track_download_note()}{need}")
    return ModelPair(*BUNDLED_PAIR, device, f"{TRACK_ENV}=gpu but no Hub access: the bundled TinyStories pair")


def setup_notebook(threads: int | None = None) -> dict[str, Any]:
    """Quiet, reproducible defaults for a notebook: CPU threads (see
    ``minifer.bench.roofline.default_threads``), no download/loading progress bars in stored outputs,
    readable figure sizes. Returns what it set, for the record."""
    from minifer.bench.roofline import default_threads

    n = threads or default_threads()
    torch.set_num_threads(n)
    try:
        import transformers

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass
    try:
        import matplotlib as mpl

        mpl.rcParams.update({"figure.dpi": 90, "figure.figsize": (9, 3.6), "axes.grid": True, "grid.alpha": 0.3,
                             "axes.spines.top": False, "axes.spines.right": False})
    except ImportError:  # pragma: no cover
        pass
    return {"torch_threads": n, "torch": torch.__version__, "cuda": torch.cuda.is_available()}


# --- the model ---------------------------------------------------------------------------------------


def model_summary(llm: "LLM") -> dict[str, Any]:
    """The numbers of a model that decide its inference cost: shapes, parameters, and bytes.

    ``params_counted`` sums the tensors of the module that was built; ``params_from_config`` is the
    closed-form count from the config (what the roofline chapter uses for models it never loads). They
    must agree, or the cost model of chapter 01 would be counting a different model."""
    from minifer.bench.roofline import kv_bytes_per_token

    cfg = llm.model_config
    counted = sum(p.numel() for p in llm.model.parameters())  # tied weights are one Parameter, counted once
    dtype_bytes = llm.dtype.itemsize
    return {
        "architecture": cfg.architecture,
        "layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "attention_heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "tied_embeddings": cfg.tie_word_embeddings,
        "max_positions": cfg.max_position_embeddings,
        "params_counted": counted,
        "params_from_config": cfg.num_parameters(),
        "dtype": str(llm.dtype).replace("torch.", ""),
        "weight_mb": counted * dtype_bytes / 1e6,
        "kv_bytes_per_token": kv_bytes_per_token(cfg, dtype_bytes),
    }


def show_source(obj: Any) -> Any:
    """The source of a minifer class or function, highlighted in Jupyter (plain text elsewhere).
    Showing the real file keeps the notebook and the engine from drifting apart."""
    from IPython.display import Code

    return Code(inspect.getsource(obj), language="python")


# --- minifer against transformers --------------------------------------------------------------------


@dataclass
class ParityReport:
    """How closely minifer reproduces Hugging Face transformers on the same checkpoint."""

    prompts: list[str]
    max_rel_logit_error: float  # max |minifer - hf| / max |hf| over every position of every prompt
    minifer_tokens: list[list[int]]
    hf_tokens: list[list[int]]
    dtype: str

    @property
    def greedy_identical(self) -> bool:
        return self.minifer_tokens == self.hf_tokens


def prompt_logits(model: torch.nn.Module, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits ``[len(token_ids), vocab]`` at every position of one prompt, in one prefill.

    The engine itself only projects the last position (``compute_logits`` on one row); here every row is
    projected so that each position can be compared with transformers."""
    from minifer.layers.attention import ContiguousKVCache

    cfg = model.config
    w = model.lm_head.weight
    n = len(token_ids)
    cache = ContiguousKVCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, n, cfg.head_dim, w.dtype, w.device)
    cache.begin_step(0, n, torch.ones(1, n, dtype=torch.bool, device=w.device))
    with torch.inference_mode():
        hidden = model(torch.tensor(token_ids, device=w.device), torch.arange(n, device=w.device), cache)
        return model.compute_logits(hidden).float()


def compare_with_transformers(llm: "LLM", prompts: Sequence[str], max_tokens: int = 24) -> ParityReport:
    """Load the same checkpoint with ``transformers.AutoModelForCausalLM`` and compare logits at every
    prompt position, then greedy completions token by token.

    Both run in float32: in bfloat16 two correct implementations differ by ~1e-2 in the logits (the order
    of additions changes the rounding), which would hide a real bug of that size. When ``llm`` runs in
    another dtype, a float32 copy of minifer's model is loaded for the comparison, run, and freed before
    transformers' model is loaded: one float32 model at a time (``minifer.gpu_plan``: 6.9 GB each for
    Qwen3-1.7B, which a 16 GB GPU holds only one of beside the chapter's own model)."""
    from transformers import AutoModelForCausalLM

    tok = llm.get_tokenizer()
    ids = [list(tok(prompt)["input_ids"]) for prompt in prompts]
    with _float32_copy(llm) as ref_llm:
        ours = [prompt_logits(ref_llm.model, i).cpu() for i in ids]
        outs = ref_llm.generate(list(prompts), SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(str(llm.model_path), dtype=torch.float32).to(llm.device).eval()
    err = 0.0
    hf_tokens: list[list[int]] = []
    for prompt_ids, our_logits in zip(ids, ours):
        with torch.inference_mode():
            x = torch.tensor([prompt_ids], device=llm.device)
            theirs = hf(x).logits[0].float().cpu()
            err = max(err, float((our_logits - theirs).abs().max() / theirs.abs().max()))
            gen = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_tokens,
                              pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        hf_tokens.append(gen[0, len(prompt_ids):].tolist())
    del hf
    return ParityReport(list(prompts), err, [o.outputs[0].token_ids for o in outs], hf_tokens, "float32")


class _float32_copy:
    """``with _float32_copy(llm) as ref:`` ``llm`` itself when it runs in float32, else a float32 copy of its
    model (KV cache held to the GPU track's budget on a GPU), freed on exit so the next float32 model fits."""

    def __init__(self, llm: "LLM"):
        self.llm, self.copy = llm, None

    def __enter__(self) -> "LLM":
        if self.llm.dtype == torch.float32:
            return self.llm
        from minifer import LLM

        kw: dict[str, Any] = {"dtype": "float32", "device": self.llm.device}
        if self.llm.device.type == "cuda":
            kw["num_kv_blocks"] = gpu_kv_blocks(str(self.llm.model_path), kw)
        self.copy = LLM(self.llm.model_path, **kw)
        return self.copy

    def __exit__(self, *exc: Any) -> None:
        if self.copy is not None:
            del self.copy
            self.copy = None
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def compare_beam_search_with_transformers(llm: "LLM", prompts: Sequence[str], params: "BeamSearchParams") -> str:
    """Run ``llm.beam_search`` and transformers' own beam search (``generate(num_beams=..., early_stopping="never")``,
    the canonical algorithm minifer implements) on the same checkpoint, both in float32 (see
    ``compare_with_transformers`` for why), and say how many finished beams are identical, token for token and in
    rank, and how far apart their scores are."""
    from transformers import AutoModelForCausalLM

    tok = llm.get_tokenizer()
    eos = None if params.ignore_eos else sorted(llm.eos_token_ids)
    with _float32_copy(llm) as ref_llm:  # one float32 model at a time (see compare_with_transformers)
        beams = ref_llm.beam_search(list(prompts), params)
    hf = AutoModelForCausalLM.from_pretrained(str(llm.model_path), dtype=torch.float32).to(llm.device).eval()
    same = total = 0
    worst = 0.0
    for prompt, ours in zip(prompts, beams):
        ids = list(tok(prompt)["input_ids"])
        x = torch.tensor([ids], device=llm.device)
        with torch.inference_mode():
            g = hf.generate(x, attention_mask=torch.ones_like(x), num_beams=params.beam_width,
                            num_return_sequences=params.beam_width, early_stopping="never",
                            length_penalty=params.length_penalty, max_new_tokens=params.max_tokens, do_sample=False,
                            output_scores=True, return_dict_in_generate=True, eos_token_id=eos,
                            pad_token_id=eos[0] if eos else 0)
        total += max(len(ours.sequences), len(g.sequences))  # a missing or extra beam counts as a difference
        for seq, row, score in zip(ours.sequences, g.sequences.tolist(), g.sequences_scores.tolist()):
            out = row[len(ids):]
            end = next((i for i, t in enumerate(out) if eos and t in eos), None)
            theirs = ids + (out if end is None else out[: end + 1])
            same += seq.tokens == theirs
            worst = max(worst, abs(seq.score - score))
    del hf
    return (f"transformers' beam search (float32): {same} of {total} finished beams identical, "
            f"every score within 1e-4 of transformers': {worst < 1e-4}")


# --- sampling ----------------------------------------------------------------------------------------


def next_token_logits(llm: "LLM", prompt: str) -> torch.Tensor:
    """The model's raw next-token logits ``[vocab]`` after ``prompt`` (float32)."""
    ids = list(llm.get_tokenizer()(prompt)["input_ids"])
    return prompt_logits(llm.model, ids)[-1]


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution ``params`` actually draws from: minifer's own ``process_logits`` (temperature,
    top-k, top-p, min-p, in that order), then softmax. Greedy params give the untempered distribution."""
    return process_logits(logits[None], [params], None).softmax(-1)[0]


def plot_sampling_filters(llm: "LLM", logits: torch.Tensor, variants: Mapping[str, SamplingParams],
                          top: int = 20) -> "Figure":
    """One panel per sampling setting: the ``top`` most likely next tokens under the model (grey
    outline) and the probability each keeps after the setting's filters (filled; missing = dropped).
    The title says how many tokens of the whole vocabulary can still be drawn."""
    import matplotlib.pyplot as plt

    tok = llm.get_tokenizer()
    raw = logits.float().softmax(-1)
    order = raw.argsort(descending=True)[:top]
    labels = [repr(tok.decode([int(t)])) for t in order]
    n = len(variants)
    ncols = min(n, 3)
    nrows = -(-n // ncols)
    fig, axes_grid = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, 3.2 * nrows), sharey=True, squeeze=False)
    axes = list(axes_grid.flat)
    x = range(top)
    for ax, (name, params) in zip(axes, variants.items()):
        p = filtered_probs(logits, params)
        kept = int((p > 0).sum())
        ax.bar(x, raw[order].tolist(), color="none", edgecolor="0.5", linewidth=0.8, label="model")
        ax.bar(x, p[order].tolist(), color="tab:blue", alpha=0.75, label="sampled from")
        ax.set_title(f"{name}: {kept:,} token{'s' if kept != 1 else ''} left", fontsize=9)
        ax.set_xticks(list(x), labels, rotation=90, fontsize=7)
    for ax in axes[n:]:
        ax.set_visible(False)
    axes[0].set_ylabel("probability")
    axes[0].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


def logprob_table(completion: "CompletionOutput", steps: int = 6) -> str:
    """The first ``steps`` generated tokens with the model's top alternatives at each step, as text.
    Probabilities are the *model's* (before temperature and truncation), as vLLM reports them."""
    lines = []
    for i, (tid, entry) in enumerate(zip(completion.token_ids[:steps], completion.logprobs or [])):
        chosen = entry[tid]
        alts = sorted(entry.values(), key=lambda lp: lp.rank)
        alt_txt = "  ".join(f"{lp.decoded_token!r} {math.exp(lp.logprob):.2g}" for lp in alts)
        lines.append(f"step {i}: chose {chosen.decoded_token!r:12} p={math.exp(chosen.logprob):<7.2g} "
                     f"rank {chosen.rank} | top: {alt_txt}")
    return "\n".join(lines)


def repeated_ngram_fraction(token_ids: Sequence[int], n: int = 4) -> float:
    """Fraction of the ``n``-grams of a completion that already appeared earlier in it: 0 for text that
    never repeats itself, near 1 for a loop. A cheap number for what repetition_penalty changes."""
    grams = [tuple(token_ids[i:i + n]) for i in range(len(token_ids) - n + 1)]
    if not grams:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams)


def sampling_playground(llm: "LLM", prompt: str = "Once upon a time", max_tokens: int = 48) -> Any:
    """Sliders for every sampling knob and a Generate button (ipywidgets).

    It builds the controls and fills the output once with the default settings, so it also works when the
    notebook runs headless (CI, nbconvert): nothing waits for a click. Without ipywidgets it returns a
    short message instead of failing."""
    try:
        import ipywidgets as w
    except ImportError:
        return "ipywidgets is not installed: pip install ipywidgets (or the course extra: pip install -e '.[course]')"

    style = {"description_width": "120px"}
    layout = w.Layout(width="420px")
    controls = {
        "temperature": w.FloatSlider(value=0.8, min=0.0, max=2.0, step=0.05, description="temperature"),
        "top_k": w.IntSlider(value=0, min=0, max=100, description="top_k (0 = off)"),
        "top_p": w.FloatSlider(value=1.0, min=0.05, max=1.0, step=0.05, description="top_p"),
        "min_p": w.FloatSlider(value=0.0, min=0.0, max=0.5, step=0.01, description="min_p"),
        "repetition_penalty": w.FloatSlider(value=1.0, min=1.0, max=2.0, step=0.05, description="repetition_penalty"),
        "seed": w.IntText(value=0, description="seed"),
        "max_tokens": w.IntSlider(value=max_tokens, min=1, max=200, description="max_tokens"),
    }
    for c in controls.values():
        c.style, c.layout = style, layout
    text = w.Text(value=prompt, description="prompt", style=style, layout=w.Layout(width="640px"))
    button = w.Button(description="Generate", button_style="primary")
    out = w.Output(layout=w.Layout(border="1px solid #ddd", padding="4px", width="640px"))

    def run(_: Any = None) -> None:
        v = {k: c.value for k, c in controls.items()}
        params = SamplingParams(temperature=v["temperature"], top_k=v["top_k"] or -1, top_p=v["top_p"],
                                min_p=v["min_p"], repetition_penalty=v["repetition_penalty"], seed=v["seed"],
                                max_tokens=v["max_tokens"])
        out.clear_output()
        with out:
            if not text.value:
                print("type a prompt")
                return
            o = llm.generate([text.value], params, use_tqdm=False)[0].outputs[0]
            print(text.value + o.text)
            print(f"\n[{len(o.token_ids)} tokens, finish_reason={o.finish_reason}, "
                  f"repeated 4-grams {repeated_ngram_fraction(o.token_ids):.0%}]")

    button.on_click(run)
    run()
    return w.VBox([text, *controls.values(), button, out])


# --- the server (chapter 00) ---------------------------------------------------------------------------


def post_json(url: str, body: dict[str, Any], *, stream: bool = False) -> tuple[int, Any]:
    """A client's POST to an OpenAI-style endpoint with the standard library: ``(status, JSON body)``, or with
    ``stream=True`` ``(status, [every server-sent event's JSON])``. Errors come back as their status and body."""
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    if not stream:
        return status, json.loads(text)
    from minifer.openai_protocol import sse_events

    return status, sse_events(text)


# --- roofline plots (chapter 01) ---------------------------------------------------------------------


def _fmt_si(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def plot_time_per_token(prefill: Sequence["StepTiming"], decode_by_batch: Mapping[int, Sequence["StepTiming"]],
                        decode_by_context: Sequence["StepTiming"] = ()) -> "Figure":
    """Left: time per token against the number of tokens that share one step: prompt length for prefill
    (batch 1), batch size for decode. Both phases get cheaper per token when more tokens share one read of
    the weights; decode starts far higher. Right: a batch-1 decode step against the context it attends to."""
    import matplotlib.pyplot as plt

    ncols = 2 if decode_by_context else 1
    fig, axes = plt.subplots(1, ncols, figsize=(5.2 * ncols, 3.8))
    axes = list(axes) if ncols > 1 else [axes]
    ax = axes[0]
    ax.plot([t.tokens for t in prefill], [t.seconds_per_token * 1e6 for t in prefill], "o-", label="prefill (batch 1)")
    for ctx, ts in decode_by_batch.items():
        ax.plot([t.batch for t in ts], [t.seconds_per_token * 1e6 for t in ts], "s--",
                label=f"decode (context {ctx})")
    ax.set(xscale="log", yscale="log", xlabel="tokens per step (prompt length, or decode batch)",
           ylabel="µs per token", title="time per token")
    ax.legend(fontsize=8)
    if decode_by_context:
        ax = axes[1]
        ctxs = [t.cost.context for t in decode_by_context]
        ax.plot(ctxs, [t.seconds * 1e3 for t in decode_by_context], "s-", color="tab:red")
        ax.set(xlabel="context (tokens in the KV cache)", ylabel="ms per decode step",
               title="batch-1 decode step vs context")
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    return fig


def plot_roofline(ceilings: "Ceilings", series: Mapping[str, Sequence["StepTiming"]],
                  annotate: bool = True) -> "Figure":
    """The roofline of this machine (log-log): attainable FLOP/s = min(matmul rate, intensity x bandwidth),
    drawn with the measured ceilings, and each measured step placed at its counted intensity and its
    achieved FLOP/s. Points far below the roof are limited by something the roofline does not model
    (per-op overhead, a kernel that cannot use all the bandwidth)."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    all_i = [t.cost.intensity for ts in series.values() for t in ts]
    lo, hi = min(all_i + [ceilings.ridge]) / 3, max(all_i + [ceilings.ridge]) * 3
    xs = np.logspace(np.log10(lo), np.log10(hi), 200)
    ax.plot(xs, np.minimum(ceilings.matmul_flops, xs * ceilings.copy_bandwidth), "k-", lw=2,
            label=f"roof: {_fmt_si(ceilings.copy_bandwidth, 'B/s')} copy, "
                  f"{_fmt_si(ceilings.matmul_flops, 'FLOP/s')} matmul")
    ax.plot(xs, np.minimum(ceilings.matmul_flops, xs * ceilings.gemv_bandwidth), "k:", lw=1,
            label=f"matrix-vector bandwidth {_fmt_si(ceilings.gemv_bandwidth, 'B/s')}")
    ax.axvline(ceilings.ridge, color="0.5", lw=0.8, ls="--")
    ax.text(ceilings.ridge * 1.08, ceilings.matmul_flops * 0.02, f"ridge\n{ceilings.ridge:.1f} FLOP/B", fontsize=8,
            color="0.35")
    markers = "os^vD"
    for k, (name, ts) in enumerate(series.items()):
        xs_p = [t.cost.intensity for t in ts]
        ys_p = [t.achieved_flops for t in ts]
        ax.plot(xs_p, ys_p, markers[k % len(markers)] + "-", ms=5, lw=0.8, label=name)
        if annotate:
            for t, x_, y_ in zip(ts, xs_p, ys_p):
                lab = f"{t.cost.new_tokens}" if t.phase == "prefill" else f"b{t.batch}"
                ax.annotate(lab, (x_, y_), textcoords="offset points", xytext=(3, -9), fontsize=6.5)
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP / byte)", ylabel="FLOP/s",
           title=f"roofline: {ceilings.device}, {ceilings.dtype}")
    ax.legend(fontsize=7.5, loc="lower right")
    fig.tight_layout()
    return fig


def plot_matvec(size_sweep: Sequence[Mapping[str, float]], batch_sweep: Sequence[Mapping[str, float]],
                bandwidth: float, mark_bytes: Iterable[float] = ()) -> "Figure":
    """Left: time of one matrix-vector product against the matrix's size: flat while a fixed per-call cost
    dominates, then rising with slope 1 at the memory bandwidth. ``mark_bytes`` marks the sizes of the
    model's own weight matrices. Right: one large matrix times a batch of vectors: the time barely moves
    while the weights dominate, so tokens per second rise with the batch."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    sizes = np.array([r["bytes"] for r in size_sweep])
    a.plot(sizes, [r["seconds"] * 1e6 for r in size_sweep], "o-", label="measured")
    a.plot(sizes, sizes / bandwidth * 1e6, "k--", lw=1, label=f"bytes / {_fmt_si(bandwidth, 'B/s')}")
    for m in mark_bytes:
        a.axvline(m, color="tab:orange", lw=0.8, alpha=0.7)
    a.set(xscale="log", yscale="log", xlabel="weight matrix size (bytes)", ylabel="µs per product",
          title="matrix x vector: overhead, cache, then bandwidth")
    a.legend(fontsize=8)
    bs = [r["batch"] for r in batch_sweep]
    b.plot(bs, [r["seconds"] * 1e6 for r in batch_sweep], "o-", label="µs per product")
    b.set(xscale="log", xlabel="vectors per product (batch)", ylabel="µs per product",
          title=f"one {_fmt_si(batch_sweep[0]['bytes'], 'B')} matrix x a batch")
    b.set_ylim(bottom=0)
    b2 = b.twinx()
    b2.plot(bs, [r["batch"] / r["seconds"] for r in batch_sweep], "s--", color="tab:green", label="vectors / s")
    b2.set_ylabel("vectors per second", color="tab:green")
    b2.set_ylim(bottom=0)
    b2.grid(False)
    fig.tight_layout()
    return fig


def plot_decode_intensity(name: str, cfg: Any, hw: "Hardware", contexts: Sequence[int] = (0, 1024, 8192, 32768),
                          batches: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)) -> "Figure":
    """Decode intensity (weights + KV cache, bf16) against batch size for one published model, one line per
    context length, with the hardware's ridge. Batching raises intensity only while the weights dominate
    the bytes; each sequence's KV cache is read for that sequence alone, so long contexts cap it."""
    import matplotlib.pyplot as plt

    from minifer.bench.roofline import decode_cost

    fig, ax = plt.subplots(figsize=(7, 4))
    for c in contexts:
        ax.plot(batches, [decode_cost(cfg, b, c, 2).intensity_weights_kv for b in batches], "o-", ms=3,
                label=f"context {c:,}")
    ax.axhline(hw.ridge, color="k", ls="--", lw=1)
    ax.text(batches[0], hw.ridge * 1.1, f"{hw.name} ridge ≈ {hw.ridge:.0f} FLOP/byte", fontsize=8)
    ax.set(xscale="log", yscale="log", xlabel="decode batch (sequences per step)", ylabel="FLOP / byte",
           title=f"{name}, bf16: decode intensity vs batch")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def format_table(rows: Sequence[Mapping[str, Any]], columns: Mapping[str, str] | None = None) -> str:
    """A fixed-width text table (no pandas needed): ``columns`` maps keys to ``"header:format"``."""
    columns = columns or {k: k for k in rows[0]}
    heads, fmts = [], []
    for key, spec in columns.items():
        head, _, fmt = spec.partition(":")
        heads.append(head)
        fmts.append((key, fmt))
    cells = [[("—" if r[k] is None else format(r[k], f)) if f else str(r[k]) for k, f in fmts] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
    line = lambda vals: "  ".join(v.rjust(wd) for v, wd in zip(vals, widths))  # noqa: E731
    return "\n".join([line(heads), line(["-" * wd for wd in widths])] + [line(c) for c in cells])


# --- the KV cache and paging (chapter 02) ------------------------------------------------------------


def plot_cache_vs_recompute(points: Sequence[Mapping[str, float]]) -> "Figure":
    """Left: time to produce the token at each position with a KV cache (one decode step) and without one
    (a forward over the whole prefix). Right: the time to generate every token up to a position, both ways
    (the left curves integrated, linearly interpolated between the measured positions)."""
    import matplotlib.pyplot as plt
    import numpy as np

    pos = np.array([p["position"] for p in points], dtype=float)
    cached = np.array([p["with_cache"] for p in points]) * 1e3
    recompute = np.array([p["recompute"] for p in points]) * 1e3
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot(pos, recompute, "o-", color="tab:red", label="no cache: recompute the prefix")
    a.plot(pos, cached, "s-", color="tab:blue", label="KV cache: one decode step")
    a.set(xlabel="position of the new token", ylabel="ms per token", title="cost of one more token")
    a.set_ylim(bottom=0)
    a.legend(fontsize=8)
    grid = np.arange(pos[0], pos[-1] + 1)
    b.plot(grid, np.cumsum(np.interp(grid, pos, recompute)) / 1e3, color="tab:red", label="no cache")
    b.plot(grid, np.cumsum(np.interp(grid, pos, cached)) / 1e3, color="tab:blue", label="KV cache")
    b.set(xlabel="position reached", ylabel="seconds, from the first position",
          title=f"generating positions {int(pos[0])}..{int(pos[-1])}")
    b.set_ylim(bottom=0)
    b.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_block_pool(block_manager: Any, lengths: Mapping[str, int], ncols: int = 8,
                    title: str = "the KV block pool") -> "Figure":
    """The physical blocks of a ``BlockManager`` as a grid, coloured by the sequence that owns each one
    (hatched when several share it), each filled up to the tokens it holds; the block tables beside it.
    ``lengths``: tokens stored by each live sequence."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    bm = block_manager
    bs = bm.block_size
    colours = plt.get_cmap("tab10").colors
    names = list(lengths)
    owners: dict[int, list[str]] = {}
    fill: dict[int, int] = {}
    for name in names:
        table = bm.block_table(name)
        for i, bid in enumerate(table):
            owners.setdefault(bid, []).append(name)
            fill[bid] = max(fill.get(bid, 0), min(bs, lengths[name] - i * bs))
    nrows = -(-bm.num_blocks // ncols)
    fig, (ax, tx) = plt.subplots(1, 2, figsize=(10, 0.62 * nrows + 1.2), gridspec_kw={"width_ratios": [1.35, 1]})
    for bid in range(bm.num_blocks):
        r, c = divmod(bid, ncols)
        y = nrows - 1 - r
        ax.add_patch(Rectangle((c, y), 0.94, 0.9, facecolor="white", edgecolor="0.6", lw=0.8))
        who = owners.get(bid)
        if who:
            colour = colours[names.index(who[0]) % len(colours)]
            ax.add_patch(Rectangle((c, y), 0.94 * fill[bid] / bs, 0.9, facecolor=colour, alpha=0.75,
                                   hatch="//" if len(who) > 1 else None, edgecolor="0.2" if len(who) > 1 else colour,
                                   lw=0.5))
            label = "+".join(who) if len("+".join(who)) <= 7 else f"{len(who)} seqs"  # too long for the cell
            ax.text(c + 0.47, y + 0.45, label, ha="center", va="center", fontsize=8, weight="bold")
        ax.text(c + 0.05, y + 0.78, str(bid), fontsize=6, color="0.35")
    ax.set_xlim(-0.1, ncols)
    ax.set_ylim(-0.1, nrows)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"{title}: {bm.num_blocks} blocks of {bs} slots (filled part = tokens held)", fontsize=9)
    lines = []
    for name in names:
        table = bm.block_table(name)
        slots = len(table) * bs
        lines.append(f"{name}: {lengths[name]:>2} tokens  table {table}\n    {slots - lengths[name]} empty slot(s) "
                     f"in its last block")
    free = bm.num_free_blocks
    lines.append(f"\nfree blocks: {free} of {bm.num_blocks}")
    tx.text(0, 1, "\n".join(lines), va="top", family="monospace", fontsize=8)
    tx.axis("off")
    fig.tight_layout()
    return fig


def plot_kv_timeline(records: Sequence[Any], max_model_len: int, block_size: int) -> "Figure":
    """Token slots over one run (a list of ``kv_memory.StepRecord``): what a max-length contiguous
    reservation, an exact (prompt + max_tokens) reservation and paging hold, against the tokens stored."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    steps = range(len(records))
    k = 1e3
    ax.plot(steps, [r.running * max_model_len / k for r in records], lw=1, color="tab:red",
            label=f"contiguous: {max_model_len} per sequence")
    ax.plot(steps, [r.reserved_exact / k for r in records], lw=1, color="tab:orange",
            label="contiguous: prompt + max_tokens")
    ax.plot(steps, [r.blocks_used * block_size / k for r in records], lw=1.2, color="tab:blue",
            label=f"paged (blocks of {block_size})")
    ax.plot(steps, [r.stored / k for r in records], lw=0.8, ls="--", color="k", label="tokens stored")
    ax.set(xlabel="engine step", ylabel="thousand token slots", title="KV memory reserved vs used")
    ax.set_ylim(0, 1.45 * max(r.running for r in records) * max_model_len / k)
    ax.legend(fontsize=7.5, loc="upper right", ncol=2)
    fig.tight_layout()
    return fig


def plot_same_memory(records: Sequence[Any], contiguous_seqs: int, max_model_len: int) -> "Figure":
    """Running sequences over a run whose paged pool holds as many slots as ``contiguous_seqs`` max-length
    reservations (a list of ``kv_memory.StepRecord``), against those ``contiguous_seqs``."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    ax.plot(range(len(records)), [r.running for r in records], lw=0.8, color="tab:blue",
            label="paged: running sequences")
    ax.axhline(contiguous_seqs, color="tab:red", lw=1.2, label=f"contiguous, max length: {contiguous_seqs} fit")
    ax.set(xlabel="engine step", ylabel="sequences in the batch",
           title=f"the same memory ({contiguous_seqs * max_model_len:,} token slots)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7.5, loc="upper right")
    fig.tight_layout()
    return fig


# The vLLM paper's memory saving from parallel sampling (Kwon et al. 2023, §6.3: Alpaca in Fig. 15, ShareGPT in the
# text; OPT-13B, 2-6 samples).
PAPER_PARALLEL_SAVING = {"Alpaca": (0.061, 0.098), "ShareGPT": (0.162, 0.305)}
PAPER_BEAM_SAVING = {"Alpaca": (0.376, 0.552), "ShareGPT": (0.443, 0.663)}  # Kwon et al. 2023, §6.3, Fig. 15


def _plot_sharing(rows: Sequence[Mapping[str, Any]], x: str, x_label: str, paper: Mapping[str, tuple[float, float]],
                  dashed: str | None, title: str) -> "Figure":
    """The share of KV blocks saved by sharing against ``x`` per (prompt, output) shape, beside the paper's ranges
    (``dashed``: a second series drawn dashed), and the peak blocks held with and without sharing."""
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys((r["prompt_len"], r["output_len"]) for r in rows))
    colours = plt.get_cmap("tab10").colors
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for (lo, hi), shade, name in zip(paper.values(), ("0.85", "0.93"), paper):
        a.axhspan(100 * lo, 100 * hi, color=shade, zorder=0)
        a.text(1.05, 100 * hi, f"vLLM paper, {name}", fontsize=7, va="bottom", color="0.3")
    for k, (p, o) in enumerate(shapes):
        sel = [r for r in rows if (r["prompt_len"], r["output_len"]) == (p, o)]
        xs = [r[x] for r in sel]
        c = colours[k]
        a.plot(xs, [100 * r["memory_saving"] for r in sel], "o-", color=c, label=f"prompt {p} + output {o}")
        if dashed is not None:
            a.plot(xs, [100 * r[dashed] for r in sel], "--", color=c, lw=0.9)
        b.plot(xs, [r["peak_blocks_unshared"] for r in sel], "s--", color=c, lw=0.9, label=f"{p} + {o}, unshared")
        b.plot(xs, [r["peak_blocks_shared"] for r in sel], "o-", color=c, label=f"{p} + {o}, shared")
    a.set(xlabel=x_label, ylabel="KV blocks saved by sharing (%)", title=title)
    a.set_ylim(bottom=0)
    a.legend(fontsize=7.5, loc="center right")
    b.set(xlabel=x_label, ylabel="peak KV blocks held", title="peak KV blocks")
    b.set_ylim(bottom=0)
    b.legend(fontsize=7, loc="upper left")
    for ax in (a, b):
        ax.set_xticks(sorted({r[x] for r in rows}))
    fig.tight_layout()
    return fig


def plot_parallel_sampling(rows: Sequence[Mapping[str, Any]]) -> "Figure":
    """From ``kv_memory.measure_parallel_sampling``: the share of KV blocks saved by sharing the prompt against n
    (measured, and the end-state arithmetic dashed), beside the paper's ranges; and the peak blocks held with and
    without sharing."""
    return _plot_sharing(rows, "n", "completions per prompt (n)", PAPER_PARALLEL_SAVING, "end_state_saving",
                         "memory saved (dashed: n finished completions)")


def plot_beam_search(rows: Sequence[Mapping[str, Any]]) -> "Figure":
    """From ``kv_memory.measure_beam_search``: the share of KV blocks saved by forking beams with shared blocks,
    against the beam width, beside the paper's ranges; and the peak blocks held with and without sharing."""
    return _plot_sharing(rows, "beam_width", "beam width", PAPER_BEAM_SAVING, None, "memory saved by beam search")


def plot_block_size_tradeoff(rows: Sequence[Mapping[str, float]], selected: int | None = None) -> "Figure":
    """Internal fragmentation (share of reserved slots left empty) and block-table entries per sequence
    against the block size, from ``kv_memory.block_size_tradeoff``; ``selected`` is marked."""
    import matplotlib.pyplot as plt

    bs = [r["block_size"] for r in rows]
    fig, a = plt.subplots(figsize=(7.5, 3.6))
    a.plot(bs, [100 * r["waste"] for r in rows], "o-", color="tab:red", label="slots wasted (%)")
    a.set(xscale="log", xlabel="block size (tokens)", ylabel="slots left empty (%)",
          title="block size: fragmentation vs table size")
    a.set_xticks(bs, [str(b) for b in bs])
    a.set_ylim(bottom=0)
    b = a.twinx()
    b.plot(bs, [r["entries_per_seq"] for r in rows], "s--", color="tab:blue", label="table entries per sequence")
    b.set(yscale="log", ylabel="block-table entries per sequence")
    b.grid(False)
    if selected is not None:
        a.axvline(selected, color="0.3", lw=1)
    handles = a.get_legend_handles_labels()[0] + b.get_legend_handles_labels()[0]
    a.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="upper center")
    fig.tight_layout()
    return fig


def block_size_explorer(lengths: Sequence[int], kv_bytes_per_token: float,
                        block_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256), initial: int = 16) -> Any:
    """A slider over block sizes (ipywidgets): for sequences of these ``lengths`` (e.g. every running
    sequence at every step of a run), the share of KV slots left empty in last blocks against the block
    table's size and the allocations per token. Draws the initial setting at once, so the notebook also
    runs headless; without ipywidgets it returns a short message."""
    try:
        import ipywidgets as w
    except ImportError:
        return "ipywidgets is not installed: pip install ipywidgets (or the course extra: pip install -e '.[course]')"
    import matplotlib.pyplot as plt
    from IPython.display import display

    from minifer.bench.kv_memory import block_size_tradeoff

    rows = block_size_tradeoff(lengths, block_sizes, kv_bytes_per_token=kv_bytes_per_token)
    by_size = {r["block_size"]: r for r in rows}
    slider = w.SelectionSlider(options=list(block_sizes), value=initial, description="block size",
                               style={"description_width": "90px"}, layout=w.Layout(width="480px"))
    out = w.Output()

    def show(_: Any = None) -> None:
        r = by_size[slider.value]
        out.clear_output(wait=True)
        with out:
            fig = plot_block_size_tradeoff(rows, slider.value)
            display(fig)
            plt.close(fig)
            print(f"block size {r['block_size']}: {r['waste']:.2%} of reserved slots empty "
                  f"(utilisation {r['utilization']:.2%}); {r['entries_per_seq']:.1f} table entries per sequence; "
                  f"{r['allocations_per_1k_tokens']:.0f} block allocations per 1,000 tokens; table = "
                  f"{r['table_bytes_per_kv_byte']:.1e} of the KV bytes")

    slider.observe(show, names="value")
    show()
    return w.VBox([slider, out])


# --- continuous batching (chapter 03) ----------------------------------------------------------------


def slot_timeline(output_lens: Sequence[int], slots: int, mode: str) -> list[tuple[int, int, int, int]]:
    """Which request holds which batch slot at which step: ``(request, slot, first step, end step)`` for every
    request (a request of ``n`` tokens holds its slot for ``n`` steps), under ``mode`` ``"static"``
    (consecutive batches of ``slots`` requests, each lasting as long as its longest member) or
    ``"continuous"`` (ideal iteration-level scheduling: a slot freed at the end of a step takes the next
    queued request at the following one). The last end step equals ``serving.static_steps`` /
    ``serving.continuous_steps``."""
    import heapq

    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    spans = []
    if mode == "static":
        start = 0
        for b in range(0, len(output_lens), slots):
            batch = output_lens[b:b + slots]
            spans += [(b + j, j, start, start + n) for j, n in enumerate(batch)]
            start += max(batch)
    elif mode == "continuous":
        free = [(0, s) for s in range(min(slots, max(len(output_lens), 1)))]
        for i, n in enumerate(output_lens):
            t, s = heapq.heappop(free)
            spans.append((i, s, t, t + n))
            heapq.heappush(free, (t + n, s))
    else:
        raise ValueError(f"mode must be 'static' or 'continuous', got {mode!r}")
    return spans


def plot_slot_timeline(output_lens: Sequence[int], slots: int) -> "Figure":
    """Batch slots (rows) over engine steps (x) for static and continuous batching of the same requests, one
    colour per request; grey is a slot computing padding for a finished request while its static batch
    runs on. The titles give the steps and the share of slot-steps that produce a token."""
    import matplotlib.pyplot as plt

    colours = plt.get_cmap("tab20").colors
    fig, axes = plt.subplots(2, 1, figsize=(10, 0.36 * slots * 2 + 1.6), sharex=True)
    useful = sum(output_lens)
    for ax, mode in zip(axes, ("static", "continuous")):
        spans = slot_timeline(output_lens, slots, mode)
        end = max(e for *_, e in spans)
        for i, s, a, e in spans:
            ax.barh(s, e - a, left=a, height=0.8, color=colours[i % len(colours)], edgecolor="white", lw=0.5)
            if e - a >= 0.06 * end:
                ax.text(a + (e - a) / 2, s, str(i), ha="center", va="center", fontsize=7)
        if mode == "static":  # the padding a finished row computes until its batch's longest request ends
            batch_end: dict[int, int] = {}
            for i, s, a, e in spans:
                batch_end[i // slots] = max(batch_end.get(i // slots, 0), e)
            for i, s, a, e in spans:
                if e < batch_end[i // slots]:
                    ax.barh(s, batch_end[i // slots] - e, left=e, height=0.8, color="0.85", hatch="///",
                            edgecolor="0.6", lw=0)
        ax.set_yticks(range(slots), [f"slot {s}" for s in range(slots)], fontsize=7)
        ax.invert_yaxis()
        ax.grid(False)
        ax.set_title(f"{mode}: {end} steps, {useful / (slots * end):.0%} of slot-steps produce a token", fontsize=9)
    axes[-1].set_xlabel("engine step (forward pass)")
    fig.tight_layout()
    return fig


def chunked_prefill_stall(llm: "LLM", settings: Mapping[str, tuple[bool, int]], *, long_prompt_len: int = 896,
                          num_decoders: int = 4, decode_tokens: int = 64, arrive_after: int = 8, rounds: int = 2,
                          seed: int = 0) -> list[dict[str, Any]]:
    """What a long prompt arriving mid-decode does to the requests already decoding, per scheduler setting.

    ``settings`` maps a name to ``(enable_chunked_prefill, max_num_batched_tokens)``. For each (rounds
    alternate the order), a fresh ``LLMEngine`` over ``llm``'s model starts ``num_decoders`` short requests
    of ``decode_tokens`` greedy tokens; after ``arrive_after`` steps a request with a ``long_prompt_len``-token
    prompt arrives. Returns per setting: the decoders' largest and median gap between tokens (ms, medians
    over rounds), the long request's TTFT (ms), how many steps its prefill took, the token budget, and the
    decoders' tokens (to check that scheduling changes no output)."""
    from minifer.bench.serving import greedy_params
    from minifer.bench.workloads import make_workload
    from minifer.engine.llm_engine import CacheConfig, LLMEngine
    from minifer.engine.scheduler import SchedulerConfig

    bos = llm.tokenizer.bos_token_id if llm.tokenizer is not None else None
    kw = dict(vocab_size=llm.model_config.vocab_size, max_model_len=llm.max_model_len, bos_token_id=bos)
    short = make_workload(num_decoders, "fixed:16", f"fixed:{decode_tokens}", seed=seed, **kw).requests
    long = make_workload(1, f"fixed:{long_prompt_len}", "fixed:8", seed=seed + 1, **kw).requests[0]
    blocks = sum(-(-(r.prompt_len + r.max_tokens) // 16) for r in [*short, long]) + 4
    names = list(settings)
    got: dict[str, dict[str, Any]] = {n: {"max_itl": [], "p50_itl": [], "ttft": []} for n in names}
    for k in range(rounds):
        for name in names if k % 2 == 0 else names[::-1]:
            chunked, budget = settings[name]
            engine = LLMEngine.from_llm(llm, CacheConfig(num_kv_blocks=blocks),
                                        SchedulerConfig(num_decoders + 1, budget, chunked))
            seqs = [engine.add_request(r.request_id, {"prompt_token_ids": r.prompt_token_ids},
                                       greedy_params(r.max_tokens)) for r in short]
            for _ in range(arrive_after):
                engine.step()
            big = engine.add_request("long", {"prompt_token_ids": long.prompt_token_ids}, greedy_params(8))
            steps = 0
            while big.metrics.first_token_time is None:
                engine.step()
                steps += 1
            while engine.has_unfinished_requests():
                engine.step()
            gaps = [b - a for s in seqs for a, b in zip(s.metrics.token_times, s.metrics.token_times[1:])]
            got[name]["max_itl"].append(1e3 * max(gaps))
            got[name]["p50_itl"].append(1e3 * sorted(gaps)[len(gaps) // 2])
            got[name]["ttft"].append(1e3 * (big.metrics.first_token_time - big.metrics.arrival_time))
            got[name]["prefill_steps"] = steps
            got[name]["tokens"] = [s.output_token_ids for s in seqs]
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return [{"setting": n, "chunked": settings[n][0], "max_num_batched_tokens": settings[n][1],
             "max_itl_ms": med(got[n]["max_itl"]), "p50_itl_ms": med(got[n]["p50_itl"]),
             "long_ttft_ms": med(got[n]["ttft"]), "prefill_steps": got[n]["prefill_steps"],
             "decoder_tokens": got[n]["tokens"]} for n in names]


def max_num_seqs_sweep(llm: "LLM", sizes: Sequence[int] = (1, 2, 4, 8, 16, 32), *, waves: int = 2,
                       output_len: int = 16, input_spec: str = "uniform:8:32", rounds: int = 1, seed: int = 0,
                       **engine_kw: Any) -> list[dict[str, float]]:
    """A saturated server at each ``max_num_seqs`` n: ``waves * n`` requests queued at t = 0, each generating
    exactly ``output_len`` greedy tokens, served by continuous batching (``serving.run_continuous``, a fresh
    engine each time). Every size runs the same number of steps with full batches, so the rows differ only in
    how many sequences share a step. With ``rounds`` > 1 the sizes run in alternating order and each keeps its
    fastest round (a busy neighbour can only slow a run down). Returns output tokens/s, steps, ms per step and
    tokens per step."""
    from minifer.bench.serving import run_continuous
    from minifer.bench.workloads import make_workload

    bos = llm.tokenizer.bos_token_id if llm.tokenizer is not None else None
    best: dict[int, dict[str, Any]] = {}
    for k in range(rounds):
        for n in sizes if k % 2 == 0 else list(sizes)[::-1]:
            w = make_workload(waves * n, input_spec, f"fixed:{output_len}", seed=seed, bos_token_id=bos,
                              vocab_size=llm.model_config.vocab_size, max_model_len=llm.max_model_len)
            m = run_continuous(llm, w, max_num_seqs=n, progress=False, **engine_kw).metrics()
            if n not in best or m["output_throughput"] > best[n]["output_throughput"]:
                best[n] = m
    return [{"max_num_seqs": n, "output_throughput": m["output_throughput"], "steps": m["steps"],
             "ms_per_step": m["ms_per_step"], "tokens_per_step": m["total_output_tokens"] / m["steps"],
             "duration_s": m["duration_s"]} for n, m in ((n, best[n]) for n in sizes)]


def plot_max_num_seqs(rows: Sequence[Mapping[str, float]]) -> "Figure":
    """Left: output tokens/s against ``max_num_seqs`` (from ``max_num_seqs_sweep``), with the line a step
    cost independent of the batch would give. Right: milliseconds per step and per generated token."""
    import matplotlib.pyplot as plt

    n = [r["max_num_seqs"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    tput = [r["output_throughput"] for r in rows]
    a.plot(n, tput, "o-", label="measured")
    a.plot(n, [tput[0] * r["tokens_per_step"] / rows[0]["tokens_per_step"] for r in rows], "k--", lw=1,
           label="if a step cost the same at any batch")
    a.set(xscale="log", yscale="log", xlabel="max_num_seqs", ylabel="output tokens / s",
          title="throughput vs batch slots")
    a.set_xticks(n, [str(x) for x in n])
    a.legend(fontsize=8)
    b.plot(n, [r["ms_per_step"] for r in rows], "o-", label="ms per step")
    b.plot(n, [r["ms_per_step"] / r["tokens_per_step"] for r in rows], "s--", label="ms per output token")
    b.set(xscale="log", yscale="log", xlabel="max_num_seqs", ylabel="milliseconds", title="cost of a step")
    b.set_xticks(n, [str(x) for x in n])
    b.legend(fontsize=8)
    fig.tight_layout()
    return fig


# --- speculative decoding (chapter 04) ---------------------------------------------------------------


def verify_cost_rounds(llm: "LLM", batch_sizes: Sequence[int], ks: Sequence[int], *, context: int = 256,
                       repeats: int = 3, rounds: int = 3) -> list[dict[str, float]]:
    """``bench.speculative.verify_cost`` run ``rounds`` times, each entry the median over the rounds. One call
    times every ``k`` in turn, so a burst of load from a neighbour on a shared CPU inflates whichever ``k``
    it hits; across rounds it hits different ones, and the median keeps the typical value. Ratios are the
    medians of the per-round ratios."""
    import statistics

    from minifer.bench.speculative import verify_cost

    runs = [verify_cost(llm, list(batch_sizes), list(ks), context=context, repeats=repeats) for _ in range(rounds)]
    return [{key: (row[key] if key == "batch" else statistics.median(run[i][key] for run in runs)) for key in row}
            for i, row in enumerate(runs[0])]


def plot_verify_cost(rows: Sequence[Mapping[str, float]]) -> "Figure":
    """The price of verification: a target forward with ``k + 1`` new tokens per sequence over one with a
    single token, against ``k``, one line per batch size (the rows of ``bench.speculative.verify_cost``).
    The dashed line at 1 is free verification; the dotted diagonal ``k + 1`` is a forward whose cost grows
    with its tokens (compute-bound), where speculation cannot win."""
    import matplotlib.pyplot as plt

    ks = sorted(int(key[len("ratio_k"):]) for key in rows[0] if key.startswith("ratio_k"))
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for r in rows:
        ax.plot([0, *ks], [1.0, *(r[f"ratio_k{k}"] for k in ks)], "o-", label=f"batch {r['batch']}")
    ax.plot([0, ks[-1]], [1, ks[-1] + 1], ":", color="0.4", label="cost proportional to tokens")
    ax.axhline(1.0, color="0.4", ls="--", lw=1, label="free")
    ax.set(xlabel="k (draft tokens verified per sequence)", ylabel="forward time / 1-token forward",
           title="what verifying k drafts costs")
    ax.set_xticks([0, *ks])
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def rejection_toy(p: Sequence[float], q: Sequence[float], n: int = 20_000, seed: int = 0,
                  threshold: float = 1e-3) -> dict[str, Any]:
    """One draft token per sequence, ``n`` sequences, through :func:`minifer.spec.rejection.rejection_sample`
    (the engine's verifier; each sequence its own seeded generator, as in the engine): the draft token is
    drawn from ``q``, the target's distribution is ``p``. Returns the frequencies of the first emitted
    token, the fraction of drafts accepted, and ``sum(min(p, q))`` (the acceptance rate theory predicts).

    ``lossless`` is a chi-squared test of the emitted counts against ``p`` (pass = p-value above
    ``threshold``); ``naive_*`` is the same for a plausible but wrong verifier that, on a rejection,
    resamples from ``p`` instead of the residual ``max(p - q, 0)`` (it emits
    ``min(p, q) + (1 - alpha) p``, which the same test must reject). Deterministic for a given ``seed``."""
    from minifer.grading_spec import chi2_pvalue
    from minifer.spec.rejection import rejection_sample

    pt, qt = torch.tensor(p, dtype=torch.float32), torch.tensor(q, dtype=torch.float32)
    if pt.shape != qt.shape or pt.dim() != 1:
        raise ValueError(f"p and q must be 1-D and of the same length, got {list(pt.shape)} and {list(qt.shape)}")
    pt, qt = pt / pt.sum(), qt / qt.sum()
    vocab = pt.numel()
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(qt, n, replacement=True, generator=gen)
    gens = [torch.Generator().manual_seed(seed + 1 + i) for i in range(n)]
    out = rejection_sample([[int(d)] for d in drafts], qt.expand(n, 1, vocab), pt.expand(n, 2, vocab), gens)
    counts = torch.bincount(torch.tensor([o[0] for o in out]), minlength=vocab)
    accepted = sum(len(o) == 2 for o in out) / n  # the draft kept, then the bonus token
    # the wrong verifier, vectorised: accept as above, but on a rejection draw from p itself
    u = torch.rand(n, generator=gen)
    keep = u < pt[drafts] / qt[drafts]
    naive = torch.where(keep, drafts, torch.multinomial(pt, n, replacement=True, generator=gen))
    naive_counts = torch.bincount(naive, minlength=vocab)
    alpha = float(torch.minimum(pt, qt).sum())
    return {"p": pt.tolist(), "q": qt.tolist(), "n": n, "alpha": alpha,
            "accepted_mass": torch.minimum(pt, qt).tolist(), "residual_mass": (pt - qt).clamp(min=0).tolist(),
            "emitted": (counts / n).tolist(), "acceptance": accepted,
            "lossless": chi2_pvalue(counts, pt) > threshold,
            "naive_emitted": (naive_counts / n).tolist(), "naive_lossless": chi2_pvalue(naive_counts, pt) > threshold,
            "naive_expected": (torch.minimum(pt, qt) + (1 - alpha) * pt).tolist()}


def plot_rejection_toy(toy: Mapping[str, Any]) -> "Figure":
    """Where each emitted token comes from (the output of :func:`rejection_toy`): a stacked bar of
    ``min(p, q)`` (drafts accepted) and ``max(p - q, 0)`` (drawn from the residual after a rejection), which
    together are ``p``; the draft's ``q`` as an outline; the measured frequencies of the correct and of the
    naive verifier as markers."""
    import matplotlib.pyplot as plt
    import numpy as np

    x = np.arange(len(toy["p"]))
    fig, ax = plt.subplots(figsize=(10, 3.6))
    ax.bar(x, toy["accepted_mass"], 0.6, color="tab:blue", alpha=0.75, label="min(p, q): draft accepted")
    ax.bar(x, toy["residual_mass"], 0.6, bottom=toy["accepted_mass"], color="tab:orange", alpha=0.75,
           label="max(p - q, 0): from the residual")
    ax.bar(x, toy["q"], 0.8, fill=False, edgecolor="0.3", ls="--", label="q (the draft)")
    ax.plot(x, toy["emitted"], "k_", ms=26, mew=2.5, label=f"emitted, rejection sampling ({toy['n']:,} samples)")
    ax.plot(x, toy["naive_emitted"], "rx", ms=9, mew=2, label="emitted, naive (resample from p)")
    ax.set(xlabel="token", ylabel="probability", title="rejection sampling: accepted + residual = p")
    ax.set_xticks(x)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def time_engines(engines: Mapping[str, "LLM"], prompts: Sequence[Any], batch_sizes: Sequence[int],
                 max_tokens: int, repeats: int = 1, baseline: str = "plain") -> list[dict[str, Any]]:
    """Time of already-built engines on the same greedy requests (``max_tokens`` each, EOS ignored), their
    steps interleaved (``bench.speculative.run_interleaved``: a slow spell of a shared machine hits every engine
    alike), for each batch size; the speedup of every engine over ``baseline`` (the median of the per-round
    ratios) and whether all engines produced the same tokens. A small live version of
    ``bench.speculative.speedup_vs_batch`` that reuses the notebook's engines (on a GPU, every extra engine
    would claim KV memory of its own)."""
    import statistics

    from minifer.bench.speculative import run_interleaved

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for llm in engines.values():  # warm-up
        llm.generate(list(prompts[:1]), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    rows = []
    for b in batch_sizes:
        batch = [prompts[i % len(prompts)] for i in range(b)]
        times: dict[str, list[float]] = {m: [] for m in engines}
        tokens: dict[str, list[list[int]]] = {}  # each engine's output tokens, from the last round
        for _ in range(repeats):
            seconds, tokens = run_interleaved(engines, batch, params)
            for name in engines:
                times[name].append(seconds[name])
        row: dict[str, Any] = {"batch": b}
        for name in engines:
            row[f"s_{name}"] = statistics.median(times[name])
            row[f"speedup_{name}"] = statistics.median(x / y for x, y in zip(times[baseline], times[name]))
        row["identical_tokens"] = all(t == tokens[baseline] for t in tokens.values())
        rows.append(row)
    return rows


def adaptive_k_table(speculator: Any, batch_sizes: Sequence[int]) -> list[dict[str, Any]]:
    """What the engine's adaptive rule picks for ``b`` decoding sequences, at its current acceptance
    estimate and measured cost tables: ``Speculator.choose_k(b)`` itself, with its periodic probe
    held off while the table is made (so the rows show the rule, and the engine's probe counter is left as
    it was). Per row: the chosen k, the predicted speedup over plain decoding of that k and of the largest
    k, and the target's measured time for ``b`` and ``b (k_max + 1)`` tokens."""
    k_max = speculator.cfg.num_speculative_tokens
    alpha = speculator.alpha_estimate()
    saved = speculator.probe_every, speculator._plain_choices, speculator._plain_hold
    speculator.probe_every = 2**62
    speculator._plain_hold = {}  # every row predicted afresh, not a decision held from the engine's last steps
    try:
        rows = []
        for b in batch_sizes:
            k = speculator.choose_k(b)
            k = k[0] if isinstance(k, tuple) else k  # (k, is_probe) in engines whose probe is a separate flag
            plain = speculator.predicted_rate(b, 0, alpha)
            rows.append({"batch": b, "k": k, "alpha": alpha,
                         "predicted_speedup": speculator.predicted_rate(b, k, alpha) / plain,
                         "predicted_speedup_kmax": speculator.predicted_rate(b, k_max, alpha) / plain,
                         "target_ms_plain": 1e3 * speculator.target_cost(b),
                         "target_ms_verify": 1e3 * speculator.target_cost(b * (k_max + 1))})
        return rows
    finally:
        speculator.probe_every, speculator._plain_choices, speculator._plain_hold = saved


def plot_adaptive_k(speculator: Any, rows: Sequence[Mapping[str, Any]]) -> "Figure":
    """Left: the speculator's measured cost tables (target and, for a draft model, draft forward time
    against the tokens in the forward, ``CostTable.curve()``), with the line of a cost proportional to the
    tokens. Right: the k that ``choose_k`` picks at each batch size and the predicted speedups (rows of
    :func:`adaptive_k_table`)."""
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, table in (("target", speculator.target_cost), ("draft", speculator.draft_cost)):
        xs, ys = table.curve()
        if xs:
            line, = a.plot(xs, [1e3 * y for y in ys], "o-", label=f"{name} forward")
            a.plot(xs, [1e3 * ys[0] * x / xs[0] for x in xs], ":", color=line.get_color(), lw=1)
    a.set(xscale="log", yscale="log", xlabel="tokens in the forward", ylabel="ms (median of recent)",
          title="measured cost tables (dotted: proportional to tokens)")
    a.legend(fontsize=8)
    bs = [r["batch"] for r in rows]
    b.step(bs, [r["k"] for r in rows], where="mid", color="tab:green", label="k chosen")
    b.set(xscale="log", xlabel="decoding sequences in the step", ylabel="k", title="adaptive k")
    b.set_xticks(bs, [str(x) for x in bs])
    b.set_ylim(-0.3, speculator.cfg.num_speculative_tokens + 0.5)
    c = b.twinx()
    c.plot(bs, [r["predicted_speedup"] for r in rows], "s--", color="tab:purple", label="predicted, chosen k")
    c.plot(bs, [r["predicted_speedup_kmax"] for r in rows], "^:", color="tab:red",
           label=f"predicted, k = {speculator.cfg.num_speculative_tokens}")
    c.axhline(1.0, color="0.5", lw=0.8)
    c.set_ylabel("predicted speedup")
    c.grid(False)
    handles = b.get_legend_handles_labels()[0] + c.get_legend_handles_labels()[0]
    b.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


def speedup_grid(alphas: Sequence[float], ks: Sequence[int], draft_cost: float) -> list[dict[str, float]]:
    """Leviathan's expected speedup ``E[tokens] / (k c + 1)`` for every ``alpha`` (rows) and ``k``
    (columns ``k1``, ``k2``, ...), and the best k up to the largest of ``ks``: a static table for when the
    widget cannot run."""
    from minifer.spec.theory import expected_speedup, optimal_k

    return [{"alpha": a, **{f"k{k}": expected_speedup(a, k, draft_cost) for k in ks},
             "best_k": optimal_k(a, draft_cost, max(ks))} for a in alphas]


def speedup_explorer(alpha: float = 0.8, k: int = 4, draft_cost: float = 0.1, k_max: int = 12) -> Any:
    """Sliders for ``alpha``, ``k`` and the draft cost ``c`` (ipywidgets): the expected speedup
    ``E[tokens] / (k c + 1)`` of ``minifer.spec.theory.expected_speedup`` against k, with the chosen k and
    the best one marked. Draws the initial setting at once, so the notebook also runs headless; without
    ipywidgets it returns a short message."""
    try:
        import ipywidgets as w
    except ImportError:
        return "ipywidgets is not installed: pip install ipywidgets (or the course extra: pip install -e '.[course]')"
    import matplotlib.pyplot as plt
    from IPython.display import display

    from minifer.spec.theory import expected_speedup, expected_tokens_per_forward, optimal_k

    style, layout = {"description_width": "150px"}, w.Layout(width="480px")
    sliders = {"alpha": w.FloatSlider(value=alpha, min=0.0, max=0.99, step=0.01, description="acceptance α"),
               "k": w.IntSlider(value=k, min=0, max=k_max, description="draft tokens k"),
               "c": w.FloatSlider(value=draft_cost, min=0.0, max=1.0, step=0.01, description="draft cost c")}
    for s in sliders.values():
        s.style, s.layout = style, layout
    out = w.Output()

    def show(_: Any = None) -> None:
        a, kk, c = sliders["alpha"].value, sliders["k"].value, sliders["c"].value
        ks = list(range(k_max + 1))
        best = optimal_k(a, c, k_max)
        out.clear_output(wait=True)
        with out:
            fig, ax = plt.subplots(figsize=(6.5, 3.4))
            ax.plot(ks, [expected_speedup(a, x, c) for x in ks], "o-", ms=4)
            ax.plot([kk], [expected_speedup(a, kk, c)], "o", color="tab:red", ms=10, label=f"k = {kk}")
            ax.axvline(best, color="tab:green", lw=1, label=f"best k = {best}")
            ax.axhline(1.0, color="0.5", lw=0.8)
            ax.set(xlabel="k", ylabel="expected speedup", title=f"α = {a:.2f}, c = {c:.2f}")
            ax.legend(fontsize=8)
            fig.tight_layout()
            display(fig)
            plt.close(fig)
            print(f"k = {kk}: {expected_tokens_per_forward(a, kk):.2f} tokens per target forward, step cost "
                  f"{kk * c + 1:.2f} target steps -> expected speedup {expected_speedup(a, kk, c):.2f}x "
                  f"(best k = {best}: {expected_speedup(a, best, c):.2f}x)")

    for s in sliders.values():
        s.observe(show, names="value")
    show()
    return w.VBox([*sliders.values(), out])


def speculative_step(spec_llm: "LLM", prompt: str, k: int = 4) -> dict[str, Any]:
    """One greedy speculative step, spelled out, for an ``LLM`` built with a draft model: the draft proposes
    ``k`` tokens greedily, one forward at a time; the target scores the prompt plus all ``k`` in **one**
    forward, which gives its greedy token at ``k + 1`` positions; ``verify_greedy`` keeps the agreeing prefix
    plus the target's own next token. Returns the token strings of each, and how many drafts were accepted."""
    from minifer.spec.rejection import verify_greedy

    if spec_llm.draft_model is None:
        raise ValueError("speculative_step needs an LLM built with speculative_config method 'draft_model'")
    tok = spec_llm.get_tokenizer()
    ids = list(tok(prompt)["input_ids"])
    drafts: list[int] = []
    for _ in range(k):
        drafts.append(int(prompt_logits(spec_llm.draft_model, ids + drafts)[-1].argmax()))
    target = prompt_logits(spec_llm.model, ids + drafts)[-(k + 1):].argmax(-1)
    emitted = verify_greedy([drafts], target[None])[0]
    words = lambda ts: [tok.decode([t]) for t in ts]  # noqa: E731
    return {"prompt": prompt, "draft": words(drafts), "target": words(target.tolist()), "emitted": words(emitted),
            "accepted": len(emitted) - 1}


# --- quantization (chapter 05) -----------------------------------------------------------------------


def decoder_linear_shapes(cfg: Any) -> dict[str, tuple[int, int]]:
    """``[N, K]`` (out x in features) of each projection of one decoder layer, fused as minifer runs them
    (the names of ``minifer.quant.linear.LINEAR_NAMES``)."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {"self_attn.qkv_proj": (q + 2 * kv, h), "self_attn.o_proj": (h, q), "mlp.gate_up_proj": (2 * i, h),
            "mlp.down_proj": (h, i)}


def quantized_linear_bytes(n: int, k: int, fmt: str, group_size: int = 128, symmetric: bool = True) -> int:
    """Bytes an ``[n, k]`` weight takes in ``fmt`` (``"bf16"``, ``"int8"``, ``"fp8"`` or ``"int4"``) as
    ``minifer.quant.formats`` lays it out: the codes, a float32 scale per row (int8, fp8) or per group of
    ``group_size`` inputs (int4), and a uint8 zero point per group for asymmetric int4."""
    if fmt == "bf16":
        return 2 * n * k
    if fmt in ("int8", "fp8"):
        return n * k + 4 * n
    if fmt == "int4":
        if k % 2 or group_size < 2 or k % group_size:
            raise ValueError(f"int4 needs an even K divisible by the group size, got K={k}, group_size={group_size}")
        groups = n * (k // group_size)
        return n * k // 2 + 4 * groups + (0 if symmetric else groups)
    raise ValueError(f"unknown format {fmt!r}: use bf16, int8, fp8 or int4")


def decode_weight_bytes(cfg: Any, fmt: str, group_size: int = 128, symmetric: bool = True) -> dict[str, Any]:
    """The weight bytes one batch-1 decode step reads when the decoder linears are stored in ``fmt`` and
    every other weight stays in bf16, as ``quantize_model`` leaves them: the lm_head (or the tied
    embedding), the norms and one embedding row. int4 groups that do not divide a layer's K fall back as in
    ``quantize_model`` (the largest power of two that divides it)."""
    from minifer.bench.roofline import layer_matmul_params, weight_bytes
    from minifer.quant.linear import _group_for

    shapes = decoder_linear_shapes(cfg)
    layers = cfg.num_hidden_layers
    params = layers * sum(n * k for n, k in shapes.values())
    assert params == layers * layer_matmul_params(cfg)
    lin = layers * sum(quantized_linear_bytes(n, k, fmt, _group_for(name, k, group_size) if fmt == "int4"
                                              else group_size, symmetric) for name, (n, k) in shapes.items())
    embedding_row = 0 if cfg.tie_word_embeddings else 2 * cfg.hidden_size
    rest = weight_bytes(cfg, 2) - 2 * params + embedding_row
    return {"format": fmt, "decoder_linears": lin, "rest_bf16": rest, "total": lin + rest,
            "bits_per_weight": 8 * lin / params, "linears_vs_bf16": 2 * params / lin,
            "total_vs_bf16": (2 * params + rest) / (lin + rest)}


def roundtrip_errors(w: torch.Tensor, group_sizes: Sequence[int] = (32, 64, 128, 256)) -> list[dict[str, Any]]:
    """Quantize ``w`` ``[N, K]`` in every format (int8, fp8, then int4 symmetric and asymmetric at each group
    size that divides K, and one group per row) and dequantize it again. Per row of the result: the bits per
    weight actually stored, the relative error ``||W - W_hat|| / ||W||`` (Frobenius), the largest error as a
    fraction of the quantization step (``within_half_step``: every element within half a step of its original,
    the formats' guarantee; None for fp8, whose step depends on the value)."""
    from minifer.quant import dequantize, quantize

    wf = w.detach().float()
    k = wf.shape[1]
    variants: list[tuple[str, int | None, bool]] = [("int8", None, True), ("fp8", None, True)]
    groups = [g for g in group_sizes if k % g == 0 and g < k] + [k]
    variants += [("int4", g, s) for s in (True, False) for g in groups]
    rows = []
    for fmt, g, sym in variants:
        qw = quantize(wf, fmt, group_size=g or 128, symmetric=sym)
        err = (wf - dequantize(qw)).abs()
        if fmt == "fp8":
            half = None
        else:
            step = qw.scales[:, None] if fmt == "int8" else qw.scales.repeat_interleave(g, dim=1)
            half = float((err / step).max()) <= 0.5 + 1e-4
        name = fmt if fmt != "int4" else f"int4 {'sym' if sym else 'asym'} " + (f"g{g}" if g < k else "per row")
        rows.append({"name": name, "format": fmt, "group_size": g, "symmetric": sym,
                     "bits_per_weight": 8 * qw.nbytes() / wf.numel(),
                     "rel_error": float(err.norm() / wf.norm()), "max_abs_error": float(err.max()),
                     "within_half_step": half})
    return rows


def plot_roundtrip_errors(panels: Mapping[str, Sequence[Mapping[str, Any]]]) -> "Figure":
    """One panel per matrix (rows of :func:`roundtrip_errors`): int4's relative round-trip error against
    its group size, symmetric and asymmetric, with int8 and fp8 (one scale per row) as horizontal lines,
    and the bits per weight of each point written beside it."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.4 * len(panels), 3.8), squeeze=False)
    for ax, (title, rows) in zip(axes[0], panels.items()):
        for fmt, color in (("int8", "tab:green"), ("fp8", "tab:purple")):
            r = next(r for r in rows if r["format"] == fmt)
            ax.axhline(r["rel_error"], color=color, ls="--", lw=1.2,
                       label=f"{fmt}, per row ({r['bits_per_weight']:.2f} bits)")
        for sym, color in ((True, "tab:blue"), (False, "tab:orange")):
            pts = [r for r in rows if r["format"] == "int4" and r["symmetric"] == sym]
            xs = list(range(len(pts)))
            ax.plot(xs, [r["rel_error"] for r in pts], "o-", color=color,
                    label=f"int4 {'symmetric' if sym else 'asymmetric (zero points)'}")
            for x, r in zip(xs, pts):
                ax.annotate(f"{r['bits_per_weight']:.2f}b", (x, r["rel_error"]), fontsize=7, xytext=(3, 4),
                            textcoords="offset points", color=color)
            ax.set_xticks(xs, [str(r["group_size"]) if "per row" not in r["name"] else f"row ({r['group_size']})"
                               for r in pts])
        ax.set(yscale="log", xlabel="int4 group size (inputs per scale)", ylabel="||W - W_hat|| / ||W||",
               title=title)
        ax.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    return fig


def int4_packing_text(qw: Any, row: int = 0, columns: int = 8) -> str:
    """The first ``columns`` codes of one row of an int4 ``QuantizedWeight`` and the bytes that hold them:
    byte ``j`` is ``code[2j] | code[2j + 1] << 4``, the even column in the low nibble."""
    from minifer.quant import unpack_int4

    if qw.fmt != "int4":
        raise ValueError(f"int4_packing_text takes an int4 weight, got {qw.fmt}")
    columns = min(columns - columns % 2, qw.shape[1])
    codes = unpack_int4(qw.qweight[row:row + 1, : columns // 2].cpu())[0].tolist()
    packed = qw.qweight[row, : columns // 2].cpu().tolist()
    lines = ["column k   " + "".join(f"{k:>5d}" for k in range(columns)),
             "code q     " + "".join(f"{q:>5d}" for q in codes),
             "byte j     " + "".join(f"{'0x%02x' % b:>10s}" for b in packed),
             "  = high|low nibble: " + "  ".join(f"{b >> 4:x}|{b & 0xF:x} (q{2 * j + 1}|q{2 * j})"
                                                 for j, b in enumerate(packed))]
    return "\n".join(lines)


@dataclass
class KernelCheck:
    """The fused dequantize-matmul kernels against ``quant_linear_reference``: whether they could run here,
    why not if they could not, and one row per (format, path)."""

    ran: bool
    message: str
    rows: list[dict[str, Any]]

    @property
    def ok(self) -> bool:
        return self.ran and all(r["ok"] for r in self.rows)


def check_quant_kernels(variants: Sequence[tuple[str, int | None, bool]] = (
        ("int8", None, True), ("fp8", None, True), ("int4", 32, True), ("int4", 64, False)),
        runs: Sequence[tuple[str, int]] = (("gemv", 1), ("splitk", 3), ("tiled", 17)), *, k: int = 192,
        n: int = 45, seed: int = 0, tol: float = 1e-5) -> KernelCheck:
    """Run ``quant_matmul`` on an odd shape (``n`` outputs, ``k`` inputs, float32 activations with a bias) for
    every format variant ``(format, group_size, symmetric)`` and ``(path, M)`` of ``runs``, and compare with
    ``quant_linear_reference``: ``ok`` when the relative error is below ``tol`` and every output element was
    written (the output starts as NaN). On a CUDA GPU natively, on the CPU under Triton's interpreter, which
    must have been switched on before triton was first imported (``kv_memory.enable_triton_interpreter``);
    without Triton (macOS) it returns ``ran=False`` and the reason."""
    from minifer.bench.kv_memory import enable_triton_interpreter

    available, message = enable_triton_interpreter()
    if not available:
        return KernelCheck(False, message, [])
    from minifer.kernels import INTERPRETING

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not INTERPRETING:
        return KernelCheck(False, "skipped: triton was imported before TRITON_INTERPRET=1 was set; restart the "
                                  "kernel and run the first cell first", [])
    from minifer.kernels.quant_matmul import quant_matmul
    from minifer.quant import quant_linear_reference, quantize

    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    bias = torch.randn(n, generator=gen)
    rows = []
    for fmt, g, sym in variants:
        qw = quantize(w, fmt, group_size=g or 128, symmetric=sym).to(device)
        for path, m in runs:
            x = torch.randn(m, k, generator=gen).to(device)
            out = torch.full((m, n), float("nan"), device=device)
            quant_matmul(x, qw, bias.to(device), path=path, out=out)
            ref = quant_linear_reference(x, qw, bias.to(device))
            err = float((out.double() - ref.double()).norm() / ref.double().norm())
            name = fmt if fmt != "int4" else f"int4 {'sym' if sym else 'asym'} g{g}"
            rows.append({"format": name, "path": path, "M": m, "shape": f"{m}x{k} @ ({n}x{k})^T", "rel_error": err,
                         "ok": bool(torch.isfinite(out).all()) and err < tol})
    return KernelCheck(True, message, rows)


def kernel_speedup_table(results: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per (weight shape, format, M) of ``python -m minifer.bench.quant_kernels`` results: the
    fastest path measured for it (M <= 16 is measured on both decode paths, gemv and splitk), with its time,
    the bf16 ``torch.matmul`` time, speed-up, bytes bound and bandwidths. ``results`` maps a label to a
    result; a later result replaces an earlier one's measurement of the same (shape, format, M, path), so
    pass the older sweep first. Each row says which result it came from (``source``)."""
    cases: dict[tuple, dict[str, Any]] = {}
    for label, res in results.items():
        for r in res["rows"]:
            cases[(r["K"], r["N"], r["format"], r["M"], r["path"])] = {
                **r, "source": label, "copy_bw_GBps": res["copy_bandwidth_Bps"] / 1e9}
    best: dict[tuple, dict[str, Any]] = {}
    paths: dict[tuple, list[str]] = {}
    for (k, n, fmt, m, path), r in cases.items():
        key = (k, n, fmt, m)
        paths.setdefault(key, []).append(path)
        if key not in best or r["us_quant"] < best[key]["us_quant"]:
            best[key] = r
    fmt_order = {"int8": 0, "int4": 1, "fp8": 2}
    shape_order = {s: i for i, s in enumerate(dict.fromkeys((k, n) for k, n, _, _ in best))}
    rows = []
    for key in sorted(best, key=lambda t: (shape_order[t[:2]], fmt_order.get(t[2], 9), t[3])):
        r = best[key]
        rows.append({"shape": f"{r['K']}x{r['N']}", "K": r["K"], "N": r["N"], "format": r["format"], "M": r["M"],
                     "path": r["path"], "paths_measured": "/".join(sorted(paths[key])), "us_quant": r["us_quant"],
                     "us_bf16": r["us_bf16"], "speedup": r["speedup"], "bytes_bound": r["bytes_bound"],
                     "GBps_quant": r["GBps_quant"], "GBps_bf16": r["GBps_bf16"],
                     "of_copy_quant": r["GBps_quant"] / r["copy_bw_GBps"],
                     "of_copy_bf16": r["GBps_bf16"] / r["copy_bw_GBps"], "config": r.get("config"),
                     "source": r["source"]})
    return rows


def plot_kernel_speedups(rows: Sequence[Mapping[str, Any]]) -> "Figure":
    """Speed-up over bf16 ``torch.matmul`` against the rows M, one panel per weight shape (rows of
    :func:`kernel_speedup_table`), a line per format, with each format's bytes bound dashed and 1x (where
    quantized weights stop paying) in grey."""
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    colors = {"int8": "tab:green", "int4": "tab:blue", "fp8": "tab:purple"}
    markers = {"gemv": "D", "splitk": "o", "tiled": "s"}
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.6 * len(shapes), 3.8), sharey=True, squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for fmt, color in colors.items():
            pts = sorted((r for r in rows if r["shape"] == shape and r["format"] == fmt), key=lambda r: r["M"])
            if not pts:
                continue
            ms = [r["M"] for r in pts]
            ax.plot(ms, [r["speedup"] for r in pts], "-", color=color, label=fmt)
            ax.plot(ms, [r["bytes_bound"] for r in pts], "--", color=color, lw=1, alpha=0.7)
            for r in pts:
                ax.plot(r["M"], r["speedup"], markers.get(r["path"], "x"), color=color, ms=6)
        ax.axhline(1.0, color="0.4", lw=0.9)
        ax.set(xscale="log", xlabel="rows M (tokens in the step)", title=f"K x N = {shape}")
        ax.set_xticks(ms, [str(m) for m in ms])
    axes[0][0].set_ylabel("speed-up over bf16 (dashed: bytes bound)")
    for path, marker in markers.items():
        axes[0][0].plot([], [], marker, color="0.3", ls="none", label=f"path {path}")
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def kernel_time_fit(rows: Sequence[Mapping[str, Any]], m: int = 1) -> list[dict[str, Any]]:
    """Split the measured time at ``m`` rows into a fixed part and a part proportional to the bytes read:
    a least-squares line ``time = fixed + bytes / bandwidth`` through the weight shapes of each format (rows
    of :func:`kernel_speedup_table`), and through bf16 ``torch.matmul``'s times on the same shapes. The slope's
    ``marginal_GBps`` is the bandwidth the kernel reaches on each *extra* byte; ``fixed_us`` is what a call
    costs however small (launch, grid tail, split-K reduction). None where the time does not grow with the bytes."""

    def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
        return my - slope * mx, slope

    at_m = [r for r in rows if r["M"] == m]
    groups: dict[str, list[tuple[float, float]]] = {}
    for r in at_m:
        nbytes = r["GBps_quant"] * 1e3 * r["us_quant"]
        groups.setdefault(f"{r['format']} ({r['path']})", []).append((nbytes, r["us_quant"]))
        groups.setdefault("bf16 torch.matmul", []).append((r["GBps_bf16"] * 1e3 * r["us_bf16"], r["us_bf16"]))
    out = []
    for name, pts in groups.items():
        if len({round(x) for x, _ in pts}) < 2:
            continue
        fixed, slope = fit(pts)
        out.append({"kernel": name, "points": len(pts), "fixed_us": fixed,
                    "marginal_GBps": 1e-3 / slope if slope > 0 else None})
    return out


def register_limited_warps(registers: int, num_warps: int, regs_per_sm: int = 65536, max_warps: int = 64) -> int:
    """Warps an SM can hold at once when registers are the only limit (sm_80 and sm_90 alike: 64K 32-bit
    registers and at most 64 warps per SM): whole blocks of ``num_warps`` warps, each thread's registers
    rounded up to a multiple of 8 as the hardware allocates them. Shared memory can lower it further."""
    per_warp = 32 * -(-registers // 8) * 8
    return min(max_warps, (regs_per_sm // per_warp) // num_warps * num_warps)


def aot_table(report: Mapping[str, Any], match: str = "quant_") -> list[dict[str, Any]]:
    """``python -m minifer.kernels.aot``'s report as one row per kernel whose name contains ``match``, with
    registers per thread, shared memory, spills, the register-limited warps per SM
    (:func:`register_limited_warps`) and the main loop's instructions per weight (None where not counted)
    side by side for each architecture compiled (``regs_80``, ``smem_80``, ``spills_80``, ``warps_80``,
    ``ipw_80``, ...)."""
    rows: dict[str, dict[str, Any]] = {}
    for k in report["kernels"]:
        if match not in k["kernel"]:
            continue
        cc = k["arch"].removeprefix("sm_")
        row = rows.setdefault(k["kernel"], {"kernel": k["kernel"], "num_warps": k["num_warps"],
                                            "num_stages": k["num_stages"]})
        row.update({f"regs_{cc}": k["registers"], f"smem_{cc}": k["shared_bytes"],
                    f"spills_{cc}": k["spill_stores"] + k["spill_loads"],
                    f"warps_{cc}": register_limited_warps(k["registers"], k["num_warps"]),
                    f"ipw_{cc}": k.get("instructions_per_weight")})
    return list(rows.values())


def quality_table(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The rows of ``python -m minifer.bench.quality``'s result with what the chapter reads off them: the
    share of positions whose top-1 next token differs from the fp32 model's on stories and on code, and how
    many times more often it differs on code (``code_over_stories``; None where neither differs)."""
    out = []
    for r in result["rows"]:
        ds, dc = 1 - r["agreement_teacher_forced"], 1 - r["code_agreement_teacher_forced"]
        out.append({**{k: v for k, v in r.items() if k not in ("quantization", "weight_bytes", "vs_rtn")},
                    "disagree_stories": ds, "disagree_code": dc,
                    "code_over_stories": dc / ds if ds > 0 else None,
                    "heldout_se_pct": 100 * r["heldout_nll_change_se"], "code_se_pct": 100 * r["code_nll_change_se"]})
    return out


def plot_quant_quality(result: Mapping[str, Any]) -> "Figure":
    """Left: the held-out perplexity change against how many times smaller than bf16 the decoder linears are
    (error bars: one paired standard error; circles symmetric, squares asymmetric, stars GPTQ). Right: how
    often the top-1 next token differs from fp32's, on stories and on Python code."""
    import matplotlib.pyplot as plt

    rows = [r for r in quality_table(result) if r["format"] not in ("fp32", "bf16")]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1, 1.3]})
    for r in rows:
        marker = "*" if r["method"] == "gptq" else "o" if r["symmetric"] else "s"
        a.errorbar(r["ratio_vs_bf16"], r["heldout_ppl_change_pct"], yerr=r["heldout_se_pct"], fmt=marker,
                   ms=10 if marker == "*" else 5, capsize=2)
        a.annotate(r["name"], (r["ratio_vs_bf16"], r["heldout_ppl_change_pct"]), fontsize=7,
                   xytext=(5, -9) if r["method"] == "gptq" else (-4, 5), textcoords="offset points",
                   ha="left" if r["method"] == "gptq" else "right")
    a.axhline(0, color="0.5", lw=0.8)
    a.set(xlabel="decoder linears: times smaller than bf16", ylabel="held-out perplexity change (%)",
          title="stories: bytes against perplexity")
    x = range(len(rows))
    b.bar([i - 0.2 for i in x], [100 * r["disagree_stories"] for r in rows], 0.4, label="stories (held-out)")
    b.bar([i + 0.2 for i in x], [100 * r["disagree_code"] for r in rows], 0.4, label="Python stdlib code")
    b.set_xticks(list(x), [r["name"] for r in rows], rotation=50, ha="right", fontsize=7)
    b.set(ylabel="top-1 differs from fp32 (%)", title="the same models on two workloads")
    b.legend(fontsize=8)
    fig.tight_layout()
    return fig


def live_quality(models: Mapping[str, Any], reference: str, windows: Mapping[str, torch.Tensor],
                 prompts: torch.Tensor, n_tokens: int = 32, batch_size: int = 8) -> list[dict[str, Any]]:
    """A small version of ``minifer.bench.quality`` on already-built models (``LLM``s or models): for each
    model, on each set of token ``windows`` (``minifer.eval.heldout_windows`` / ``stdlib_windows``), the
    perplexity, its change against ``reference`` in percent with one paired standard error (over windows), and
    the teacher-forced top-1 agreement; then the free-running greedy agreement over ``n_tokens`` from
    ``prompts`` (``minifer.eval.generation_agreement``'s definition)."""
    from minifer.eval import greedy_continuations, prefix_agreement, score_windows

    nets = {name: m if isinstance(m, torch.nn.Module) else m.model for name, m in models.items()}
    if reference not in nets:
        raise ValueError(f"reference {reference!r} is not one of {list(nets)}")
    scores = {name: {dom: score_windows(net, w, batch_size) for dom, w in windows.items()}
              for name, net in nets.items()}
    gens = {name: greedy_continuations(net, prompts, n_tokens) for name, net in nets.items()}
    rows = []
    for name in nets:
        row: dict[str, Any] = {"model": name}
        for dom in windows:
            s, ref = scores[name][dom], scores[reference][dom]
            d = s.nll.double().mean(1) - ref.nll.double().mean(1)
            row.update({f"{dom}_ppl": s.perplexity, f"{dom}_change_pct": 100 * (s.perplexity / ref.perplexity - 1),
                        f"{dom}_se_pct": 100 * float(d.std() / len(d) ** 0.5) if len(d) > 1 else 0.0,
                        f"{dom}_top1": s.agreement(ref)})
        row["generation_agreement"] = prefix_agreement(gens[name], gens[reference])
        rows.append(row)
    return rows


def kv_cache_runs(pair: ModelPair, kv_cache_dtypes: Sequence[str], prompts: Sequence[str], max_tokens: int = 32,
                  **engine_kw: Any) -> list[dict[str, Any]]:
    """Build the pair's target once per KV-cache format, in turn (each engine is freed before the next, so
    on a GPU each sees the same free memory), with the same cache budget ``engine_kw`` (``kv_cache_memory``
    on the CPU, ``gpu_memory_utilization`` on CUDA); generate greedily (EOS ignored) and report the blocks the
    budget bought (``stats()["kv_blocks_total"]``), the bytes per cached token, and how many tokens and whole
    sequences match the first format's."""
    import gc

    from minifer.layers.paged_attention import PagedKVCache

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rows, first = [], None
    for kv in kv_cache_dtypes:
        llm = pair.load("target", kv_cache_dtype=kv, **engine_kw)
        cfg, bm = llm.model_config, llm.engine.block_manager
        tokens = [o.outputs[0].token_ids for o in llm.generate(list(prompts), params, use_tqdm=False)]
        per_block = PagedKVCache.bytes_per_block(cfg.num_hidden_layers, bm.block_size, cfg.num_key_value_heads,
                                                 cfg.head_dim, llm.dtype, kv)
        first = tokens if first is None else first
        rows.append({"kv_cache_dtype": kv, "model_dtype": str(llm.dtype).replace("torch.", ""),
                     "kv_blocks_total": llm.stats()["kv_blocks_total"], "bytes_per_token": per_block / bm.block_size,
                     "token_agreement": sum(a == b for x, y in zip(tokens, first) for a, b in zip(x, y))
                     / sum(map(len, first)),
                     "identical_sequences": sum(x == y for x, y in zip(tokens, first)), "sequences": len(first)})
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows

"""Chapter 00's helpers: the model's summary, parity with transformers, the sampling knobs, the server."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from minifer.sample.sampler import process_logits
from minifer.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:  # imported lazily at run time: matplotlib and ipywidgets are course extras
    from matplotlib.figure import Figure

    from minifer.entrypoints.llm import LLM
    from minifer.outputs import CompletionOutput


# --- the model ---------------------------------------------------------------------------------------


def model_summary(llm: "LLM") -> dict[str, Any]:
    """The numbers of a model that decide its inference cost: shapes, parameters, and bytes.

    ``params_counted`` sums the tensors of the module that was built; ``params_from_config`` is the
    closed-form count from the config (what the roofline chapter uses for models it never loads). They
    must agree, or the cost model of chapter 01 would be counting a different model."""
    from minifer_course.roofline import kv_bytes_per_token

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
    from minifer.attention.layer import ContiguousKVCache

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

    On the CPU both run in float32: in bfloat16 two correct implementations differ by ~1e-2 in the logits
    (the order of additions changes the rounding), which would hide a real bug of that size; when ``llm``
    runs in another dtype there, a float32 copy of minifer's model is compared and freed before transformers'
    model is loaded. On a GPU both run in ``llm``'s own dtype (``ParityReport.dtype`` says which): two float32
    copies of Qwen3-1.7B (6.9 GB each) beside the chapter's engine do not fit a 16 GB GPU
    (``minifer_course.gpu_plan``), so the logit error there is 16-bit rounding's size and a greedy
    completion may part from transformers' at a near-tie."""
    from transformers import AutoModelForCausalLM

    tok = llm.get_tokenizer()
    ids = [list(tok(prompt)["input_ids"]) for prompt in prompts]
    with _reference_copy(llm) as ref_llm:
        ours = [prompt_logits(ref_llm.model, i).cpu() for i in ids]
        outs = ref_llm.generate(list(prompts), SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
        dtype = ref_llm.dtype
    hf = AutoModelForCausalLM.from_pretrained(str(llm.model_path), dtype=dtype).to(llm.device).eval()
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
    return ParityReport(list(prompts), err, [o.outputs[0].token_ids for o in outs], hf_tokens,
                        str(dtype).replace("torch.", ""))


class _reference_copy:
    """``with _reference_copy(llm) as ref:`` the engine a parity check compares with transformers: ``llm``
    itself when it runs in float32 or on a GPU (there in its own dtype: no second copy), else a float32 copy
    of its model, freed on exit before transformers' model is loaded."""

    def __init__(self, llm: "LLM"):
        self.llm, self.copy = llm, None

    def __enter__(self) -> "LLM":
        if self.llm.dtype == torch.float32 or self.llm.device.type == "cuda":
            return self.llm
        from minifer import LLM

        self.copy = LLM(self.llm.model_path, dtype="float32", device=self.llm.device)
        return self.copy

    def __exit__(self, *exc: Any) -> None:
        if self.copy is not None:
            del self.copy
            self.copy = None
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def compare_beam_search_with_transformers(llm: "LLM", prompts: Sequence[str], params: "BeamSearchParams") -> str:
    """Run ``llm.beam_search`` and transformers' own beam search (``generate(num_beams=..., early_stopping="never")``,
    the canonical algorithm minifer implements) on the same checkpoint, both in float32 on the CPU and in the
    model's dtype on a GPU (see ``compare_with_transformers`` for why), and say how many finished beams are
    identical, token for token and in rank, and how far apart their scores are."""
    from transformers import AutoModelForCausalLM

    tok = llm.get_tokenizer()
    eos = None if params.ignore_eos else sorted(llm.eos_token_ids)
    with _reference_copy(llm) as ref_llm:  # one model of minifer's at a time (see compare_with_transformers)
        beams = ref_llm.beam_search(list(prompts), params)
        dtype = ref_llm.dtype
    hf = AutoModelForCausalLM.from_pretrained(str(llm.model_path), dtype=dtype).to(llm.device).eval()
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
    if dtype != torch.float32:  # 16-bit sums of log-probabilities differ by rounding; say by how much
        return (f"transformers' beam search ({str(dtype).replace('torch.', '')}): {same} of {total} finished beams "
                f"identical, largest score difference {worst:.2g}")
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
    from minifer.entrypoints.openai.protocol import sse_events

    return status, sse_events(text)

"""Chapter 04's experiments: verify cost, the rejection-sampling toy, timed engines, adaptive k, speedup theory."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from minifer.sampling_params import SamplingParams
from minifer_course.ch00_generation import prompt_logits

if TYPE_CHECKING:  # imported lazily at run time: matplotlib and ipywidgets are course extras
    from matplotlib.figure import Figure

    from minifer.entrypoints.llm import LLM


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
    """One draft token per sequence, ``n`` sequences, through :func:`minifer.sample.rejection_sampler.rejection_sample`
    (the engine's verifier; each sequence its own seeded generator, as in the engine): the draft token is
    drawn from ``q``, the target's distribution is ``p``. Returns the frequencies of the first emitted
    token, the fraction of drafts accepted, and ``sum(min(p, q))`` (the acceptance rate theory predicts).

    ``lossless`` is a chi-squared test of the emitted counts against ``p`` (pass = p-value above
    ``threshold``); ``naive_*`` is the same for a plausible but wrong verifier that, on a rejection,
    resamples from ``p`` instead of the residual ``max(p - q, 0)`` (it emits
    ``min(p, q) + (1 - alpha) p``, which the same test must reject). Deterministic for a given ``seed``."""
    from minifer.sample.rejection_sampler import rejection_sample
    from minifer_course.grading.spec import chi2_pvalue

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
    estimate and measured cost tables (``speculator``: the engine's ``AdaptiveK``, ``llm.engine.speculator.adaptive``):
    ``AdaptiveK.choose_k(b)`` itself, with its periodic probe and the measured trials' veto
    (``measured_allows``) held off while the table is made (so the rows show the rule, and the engine's counters
    are left as they were). Per row: the chosen k, the predicted speedup over plain decoding of that k and of the largest
    k, and the target's measured time for ``b`` and ``b (k_max + 1)`` tokens."""
    k_max = speculator.cfg.num_speculative_tokens
    alpha = speculator.alpha_estimate()
    saved = speculator.probe_every, speculator.plain_choices, speculator.plain_hold
    speculator.probe_every = 2**62
    speculator.plain_hold = {}  # every row predicted afresh, not a decision held from the engine's last steps
    speculator.measured_allows = lambda b: True  # an instance attribute over the method, deleted below
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
        speculator.probe_every, speculator.plain_choices, speculator.plain_hold = saved
        del speculator.measured_allows


def plot_adaptive_k(speculator: Any, rows: Sequence[Mapping[str, Any]]) -> "Figure":
    """``speculator``: the engine's ``AdaptiveK``. Left: its measured cost tables (target and, for a draft model,
    draft forward time against the tokens in the forward, ``CostTable.curve()``), with the line of a cost
    proportional to the tokens. Right: the k that ``choose_k`` picks at each batch size and the predicted speedups
    (rows of :func:`adaptive_k_table`)."""
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
    from minifer.spec_decode.theory import expected_speedup, optimal_k

    return [{"alpha": a, **{f"k{k}": expected_speedup(a, k, draft_cost) for k in ks},
             "best_k": optimal_k(a, draft_cost, max(ks))} for a in alphas]


def speedup_explorer(alpha: float = 0.8, k: int = 4, draft_cost: float = 0.1, k_max: int = 12) -> Any:
    """Sliders for ``alpha``, ``k`` and the draft cost ``c`` (ipywidgets): the expected speedup
    ``E[tokens] / (k c + 1)`` of ``minifer.spec_decode.theory.expected_speedup`` against k, with the chosen k and
    the best one marked. Draws the initial setting at once, so the notebook also runs headless; without
    ipywidgets it returns a short message."""
    try:
        import ipywidgets as w
    except ImportError:
        return "ipywidgets is not installed: pip install ipywidgets (or the course extra: pip install -e '.[course]')"
    import matplotlib.pyplot as plt
    from IPython.display import display

    from minifer.spec_decode.theory import (
        expected_speedup,
        expected_tokens_per_forward,
        optimal_k,
    )

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
    from minifer.sample.rejection_sampler import verify_greedy

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


def benchmark_report(spec: Mapping[str, Any]) -> str:
    """Section 5's reading of the committed benchmark as text: the batch-1 sweep over fixed ``k``, each method's
    speedups with the confidence interval of every median (``sb.median_ci``), and the project's two targets."""
    from minifer.bench import speculative as sb
    from minifer_course.common import format_table

    ci = lambda c: f"{c[0]:.3f}-{c[1]:.3f}"  # noqa: E731
    lines = [f"{name}, batch 1, fixed k: " + "  ".join(f"k={r['k']} {r['speedup']:.2f}x" for r in rows)
             for name, rows in spec["speedup_vs_k"].items()] + [""]
    for name, sp in spec["speedup"].items():
        lines.append(f"{name} (k = {sp['k_fixed']} fixed, or adaptive up to {sp['k_fixed']}; "
                     f"{sp['max_tokens']} tokens per request)")
        lines.append(format_table(
            [{**r, "plain": r["seconds"]["plain"], "cf": ci(r["ci_fixed"]), "ca": ci(r["ci_adaptive"]),
              "caa": ci(r["ci_plain_again"]), "coverage": r["ci_adaptive"][2]} for r in sp["rows"]],
            {"batch": "batch:d", "rounds": "rounds:d", "plain": "plain (s):.2f", "speedup_fixed": "fixed k:.2f",
             "cf": "interval", "speedup_adaptive": "adaptive k:.3f", "ca": "interval", "adaptive_mean_k": "mean k:.2f",
             "speedup_plain_again": "A/A:.3f", "caa": "interval", "coverage": "coverage:.3f",
             "identical_tokens": "same tokens"}))
        lines.append("")
    fixed1 = spec["speedup"]["draft_model"]["rows"][0]["speedup_fixed"]
    v = sb.adaptive_verdict(spec["speedup"])
    slower = "yes" if v["met_within_resolution"] else "no, " + str(v["measurably_slower"])
    lines += [
        f"target 1, fixed k >= 1.5x at batch 1 (draft model): {fixed1:.2f}x -> {'met' if fixed1 >= 1.5 else 'not met'}",
        f"target 2, adaptive k >= 1.0x at every batch (both methods): lowest median {v['lowest_median']:.3f}x "
        f"({v['lowest_at'][0]}, batch {v['lowest_at'][1]}); {v['cells_below_1']} of {v['cells']} medians below 1.0",
        f"  no cell measurably slower (every interval reaches 1.0): {slower}; the intervals allow a slowdown of at "
        f"most {100 * v['largest_shortfall_allowed']:.1f}%",
        f"  A/A intervals that miss 1.0: {v['aa_intervals_missing_1'] or 'none'} (chance alone gives "
        f"{v['aa_misses_expected']:.1f} of {v['cells']} at these coverages)"]
    return "\n".join(lines)

def literature_summary(spec: Mapping[str, Any], live: Mapping[str, Any]) -> str:
    """Section 10's table as Markdown: each claim of the article, the literature's figure with its conditions, and
    ours, from the committed benchmark (``spec``) and this notebook's live cells (``live``: ``target``, ``device``,
    ``prompts``, ``same_tokens``, ``toy``, ``verify_cost``, ``ngram_rows``, ``command``)."""
    from minifer.bench import speculative as sb

    verdict = {True: "pass", False: "fail"}
    dm, ng = spec["speedup"]["draft_model"]["rows"], spec["speedup"]["ngram_grounded"]["rows"]
    k_fixed = spec["speedup"]["draft_model"]["k_fixed"]
    k4 = next(r for r in spec["tokens_per_forward"]["draft_model"] if r["k"] == 4)
    v = sb.adaptive_verdict(spec["speedup"])
    vc, toy, rows = live["verify_cost"], live["toy"], live["ngram_rows"]
    curve = lambda rows_, key: " → ".join(f"{r[key]:.2f}x" for r in rows_)  # noqa: E731
    cfg = spec["config"]
    cond = (f"{cfg['model']} + {cfg['draft']}, {cfg['device']}, {cfg['torch_threads']} thread(s), greedy, "
            f"`{live['command']}`")
    table = [
        ("quality unchanged: the target verifies every token",
         "Leviathan et al. 2023, Chen et al. 2023: the output distribution is provably the target's",
         f"greedy: the same tokens with and without speculation for all {live['prompts']} prompts and all three "
         f"engines ({live['same_tokens']}); sampled: rejection sampling passes a χ² test against `p` "
         f"({verdict[toy['lossless']]}), resampling from `p` fails it ({verdict[toy['naive_lossless']]})"),
        ("checking k tokens costs about one step", "decode is memory-bound (chapter 01)",
         f"live, batch 1: a target forward over 5 tokens = {vc[0]['ratio_k4']:.2f}x a decode step; batch 16: "
         f"{vc[-1]['ratio_k4']:.2f}x ({live['target']}, {live['device']})"),
        ("several tokens per expensive pass", "E = (1 − α^(k+1)) / (1 − α) (Leviathan et al., Eq. 1)",
         f"k = 4: {k4['tokens_per_forward']:.2f} tokens per forward at α = {k4['alpha']:.3f}, formula "
         f"{k4['formula']:.2f} ({cond})"),
        ("2-3x at low to medium concurrency", "2.6-3.4x / 2.3-3.1x (T5-XXL, batch 1); 2-2.5x (Chinchilla 70B); "
         "vLLM: draft model up to 1.5x, n-gram up to 2.8x at 1 QPS (Llama-3-70B, 4×H100); EAGLE-3 1.81x at batch 2 "
         "(H100, SGLang)",
         f"batch 1, k = {k_fixed}: draft model **{dm[0]['speedup_fixed']:.2f}x** fixed, "
         f"{dm[0]['speedup_adaptive']:.2f}x adaptive; n-gram on grounded text **{ng[0]['speedup_fixed']:.2f}x** "
         f"fixed ({cond})"),
        ("the gain shrinks as the hardware saturates", "EAGLE-3 1.81x → 1.48x → 1.38x at batch 2 / 16 / 64 "
         "(SGLang, H100); 1.75x → 1.01x at batch 2 / 56 (vLLM, RTX 3090); vLLM blog: 1.4x and 1.8x slowdowns at "
         "high QPS",
         f"draft model, fixed k = {k_fixed}: {curve(dm, 'speedup_fixed')} at batch "
         f"{' / '.join(str(r['batch']) for r in dm)} ({cond})"),
        ("adaptive k: speculate only at low load", "—",
         f"draft model, adaptive: {curve(dm, 'speedup_adaptive')} (mean k {dm[0]['adaptive_mean_k']:.1f} at batch "
         f"{dm[0]['batch']}, {dm[-1]['adaptive_mean_k']:.1f} at {dm[-1]['batch']}); target ≥ 1.0x everywhere: "
         f"lowest median {v['lowest_median']:.3f}x, {len(v['measurably_slower'])} of {v['cells']} intervals wholly "
         f"below 1.0 (the A/A reaches {min(r['speedup_plain_again'] for r in dm + ng):.3f}x)"),
        ("n-gram lookup on input-grounded text", "prompt lookup 2-4x (Mistral-7B, A100, greedy)",
         f"live α {rows[1]['spec_alpha']:.2f} on grounded prompts vs {rows[0]['spec_alpha']:.2f} on fresh stories; "
         f"speedup at batch 1 / {ng[-1]['batch']}: {ng[0]['speedup_fixed']:.2f}x / {ng[-1]['speedup_fixed']:.2f}x "
         f"fixed, {ng[0]['speedup_adaptive']:.2f}x / {ng[-1]['speedup_adaptive']:.2f}x adaptive"),
    ]
    return ("| claim (article) | literature (source, conditions) | ours (measured, conditions) |\n|---|---|---|\n"
            + "\n".join(f"| {a} | {b} | {c} |" for a, b, c in table))

"""Chapter 02's plots and widgets: cache vs recompute, the block pool, KV timelines, sharing blocks, block size."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported lazily at run time: matplotlib and ipywidgets are course extras
    from matplotlib.figure import Figure


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


def plot_block_pool(kv_cache_manager: Any, lengths: Mapping[str, int], ncols: int = 8,
                    title: str = "the KV block pool") -> "Figure":
    """The physical blocks of a ``KVCacheManager`` as a grid, coloured by the sequence that owns each one
    (hatched when several share it), each filled up to the tokens it holds; the block tables beside it.
    ``lengths``: tokens stored by each live sequence."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    bm = kv_cache_manager
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

    from minifer_course.kv_memory import block_size_tradeoff

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

"""What every chapter's notebook shares: which models to run, the notebook's setup, source listings, text tables.

One switch chooses the hardware story: ``choose_models()`` returns the bundled TinyStories pair on a CPU
(or when the Hugging Face Hub cannot be reached) and a real Qwen3 pair on a CUDA GPU; the environment
variables ``MINIFER_TARGET`` / ``MINIFER_DRAFT`` override either. Every notebook cell works with both.
"""

from __future__ import annotations

import inspect
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # imported lazily at run time: matplotlib and ipywidgets are course extras

    from minifer.engine.llm import LLM


BUNDLED_PAIR = ("tinystories-target", "tinystories-draft")
GPU_PAIR = ("Qwen/Qwen3-1.7B", "Qwen/Qwen3-0.6B")

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
        """``LLM`` for the target (or ``which="draft"``) on this pair's device; ``kwargs`` go to ``LLM``."""
        from minifer import LLM

        name = {"target": self.target, "draft": self.draft}[which]
        kwargs.setdefault("device", self.device)
        return LLM(name, **kwargs)

    def __str__(self) -> str:
        return f"target={self.target}  draft={self.draft}  device={self.device}  ({self.reason})"


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


def choose_models(env: Mapping[str, str] | None = None) -> ModelPair:
    """The one setting that switches a notebook between the CPU and the GPU story.

    - ``MINIFER_TARGET`` / ``MINIFER_DRAFT`` (bundled names, local folders or hub ids) win when set.
    - On a CUDA machine whose Hub is reachable (or which has them cached): Qwen3-1.7B with Qwen3-0.6B as
      draft, the sizes where memory bandwidth, batching and speculation behave as in production.
    - Otherwise the bundled TinyStories pair (9.5M and 0.66M parameters), which runs in seconds on a
      laptop CPU and needs no download.
    """
    env = os.environ if env is None else env
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target, draft = env.get("MINIFER_TARGET"), env.get("MINIFER_DRAFT")
    if target or draft:
        default = BUNDLED_PAIR
        if device == "cuda" and all(_in_hf_cache(r) for r in GPU_PAIR):
            default = GPU_PAIR
        return ModelPair(target or default[0], draft or default[1], device, "set by MINIFER_TARGET/MINIFER_DRAFT")
    if device == "cpu":
        return ModelPair(*BUNDLED_PAIR, device, "no CUDA GPU: the bundled TinyStories pair")
    if all(_in_hf_cache(r) for r in GPU_PAIR) or hub_reachable():
        return ModelPair(*GPU_PAIR, device, "CUDA GPU and Hugging Face Hub available")
    return ModelPair(*BUNDLED_PAIR, device, "CUDA GPU but no Hub access: the bundled TinyStories pair")


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


def show_source(obj: Any) -> Any:
    """The source of a minifer class or function, highlighted in Jupyter (plain text elsewhere).
    Showing the real file keeps the notebook and the engine from drifting apart."""
    from IPython.display import Code

    return Code(inspect.getsource(obj), language="python")


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

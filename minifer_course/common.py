"""What every chapter's notebook shares: which models to run, the notebook's setup, source listings, text tables.

One switch chooses the hardware story: ``choose_models()`` returns the bundled TinyStories pair (the CPU
track, the default everywhere) unless ``MINIFER_TRACK=gpu`` asks for the GPU track, a real Qwen3 pair on a
CUDA GPU, which downloads a few GB and says so first; ``MINIFER_TARGET`` / ``MINIFER_DRAFT`` override either.
Every notebook cell works with both.
"""

from __future__ import annotations

import inspect
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from minifer_course.hosted import TRITON_MIN_CAPABILITY, choose_track

if TYPE_CHECKING:  # imported lazily at run time: matplotlib and ipywidgets are course extras

    from minifer.entrypoints.llm import LLM


BUNDLED_PAIR = ("tinystories-target", "tinystories-draft")
GPU_PAIR = ("Qwen/Qwen3-1.7B", "Qwen/Qwen3-0.6B")
TRACK_ENV = "MINIFER_TRACK"  # "gpu" opts into the GPU track; anything else (or unset) is the CPU track
# (a hosted notebook's setup cell sets it: minifer_course.hosted.setup)

# --- which models ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelPair:
    """The target model a chapter studies and the draft model speculative decoding pairs with it."""

    target: str
    draft: str
    device: str
    reason: str
    chapter: str | None = None  # "00"...: on a GPU, its KV caches are sized after the chapter's models

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    def load(self, which: str = "target", **kwargs: Any) -> "LLM":
        """``LLM`` for the target (or ``which="draft"``) on this pair's device; ``kwargs`` go to ``LLM``.

        On a GPU each engine's KV cache is sized after the models: its share of what the GPU has left once
        every model of ``chapter`` is counted (``minifer_course.gpu_plan.kv_share``; ``GPU_KV_CACHE_BYTES``
        when no chapter is named), at most the blocks a cell asks for. The engine's own default takes 90% of
        the free memory, which left nothing for the next model a chapter loads."""
        from minifer import LLM

        name = {"target": self.target, "draft": self.draft}[which]
        kwargs.setdefault("device", self.device)
        if str(kwargs["device"]).startswith("cuda"):
            kwargs["num_kv_blocks"] = gpu_kv_blocks(name, kwargs, self.kv_budget(kwargs))
        return LLM(name, **kwargs)

    def kv_budget(self, llm_kwargs: Mapping[str, Any] | None = None) -> int:
        """KV bytes for one engine of this pair on the GPU (``load``'s rule), checked against the chapter's plan;
        chapter 06 passes it to ``minifer_course.stacking`` as its memory budget beyond the weights."""
        from minifer.entrypoints.llm import resolve_dtype
        from minifer_course.gpu_plan import GPU_KV_CACHE_BYTES, kv_share

        if self.chapter is None:
            return GPU_KV_CACHE_BYTES
        device = torch.device((llm_kwargs or {}).get("device", self.device))
        dtype = resolve_dtype((llm_kwargs or {}).get("dtype", "auto"), device)
        return kv_share(self.chapter, model_config(self.target), model_config(self.draft), dtype.itemsize,
                        gpu_available_bytes(device))

    def __str__(self) -> str:
        return f"target={self.target}  draft={self.draft}  device={self.device}  ({self.reason})"


def model_config(name: str) -> Any:
    """A model's ``ModelConfig`` from its config.json alone: nothing but that file is fetched."""
    from minifer.model_loader import load_config, resolve_model

    return load_config(resolve_model(name, need_weights=False))


def gpu_available_bytes(device: Any = "cuda") -> int:
    """GPU memory this process can use: what is free plus what its allocator already holds (the engines a
    chapter loaded before), so every engine of a chapter computes its share from the same total."""
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return free + torch.cuda.memory_reserved(torch.device(device))


def gpu_kv_blocks(model: str, llm_kwargs: Mapping[str, Any], budget: int) -> int:
    """The KV blocks an engine of ``model`` gets on the GPU track (``minifer_course.gpu_plan``): what ``budget``
    bytes hold in the engine's dtype and cache format (a speculating engine's blocks hold its draft's part
    too), at most ``num_kv_blocks`` if given."""
    from minifer.entrypoints.llm import resolve_dtype
    from minifer_course.gpu_plan import kv_blocks_within

    dtype = resolve_dtype(llm_kwargs.get("dtype", "auto"), torch.device(llm_kwargs.get("device", "cuda")))
    spec = llm_kwargs.get("speculative_config") or {}
    draft = model_config(spec["model"]) if spec.get("method") == "draft_model" and spec.get("model") else None
    return kv_blocks_within(model_config(model), budget, dtype.itemsize, llm_kwargs.get("block_size", 16),
                            llm_kwargs.get("kv_cache_dtype", "auto"), llm_kwargs.get("num_kv_blocks"), draft)


def gpu_track_download_note(pair: Sequence[str] = GPU_PAIR) -> str:
    """What the GPU track downloads from the Hugging Face Hub, said before it does: each hub model not yet in
    the local cache and its weights' size (parameters x 2 bytes, from the shipped config.json)."""
    from minifer.config import ModelConfig
    from minifer.model_loader import SHIPPED_CONFIGS

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
      needs a GPU of 16 GB; with ``chapter`` (``"00"``...) the reason also gives the GPU memory that chapter
      needs at least, and the pair sizes the chapter's KV caches after its models (``minifer_course.gpu_plan``).
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
        return ModelPair(*pair, device, f"set by MINIFER_TARGET/MINIFER_DRAFT; {gpu_track_download_note(pair)}",
                         chapter)
    if not cuda:
        why = f"{TRACK_ENV}=gpu, but " if gpu_track else ""
        return ModelPair(*BUNDLED_PAIR, "cpu", f"{why}no CUDA GPU: the bundled TinyStories pair")
    if gpu_track and tuple(torch.cuda.get_device_capability()) < TRITON_MIN_CAPABILITY:
        _, why = choose_track("gpu", tuple(torch.cuda.get_device_capability()), hosted=False)
        return ModelPair(*BUNDLED_PAIR, "cpu", f"{TRACK_ENV}=gpu, but {why}")
    if not gpu_track:
        return ModelPair(*BUNDLED_PAIR, "cpu", f"the CPU track; {TRACK_ENV}=gpu for the GPU track, which "
                                               f"{gpu_track_download_note()}")
    if all(_in_hf_cache(r) for r in GPU_PAIR) or hub_reachable():
        need = ""
        if chapter is not None:
            from minifer_course.gpu_plan import gpu_track_needs

            need = (f"; chapter {chapter} needs {gpu_track_needs()[chapter] / 2**30:.1f} GiB of GPU memory, and its "
                    f"KV caches take what its models leave")
        return ModelPair(*GPU_PAIR, device, f"the GPU track ({TRACK_ENV}=gpu): {gpu_track_download_note()}{need}",
                         chapter)
    return ModelPair(*BUNDLED_PAIR, device, f"{TRACK_ENV}=gpu but no Hub access: the bundled TinyStories pair",
                     chapter)


def setup_notebook(threads: int | None = None) -> dict[str, Any]:
    """Quiet, reproducible defaults for a notebook: CPU threads (see
    ``minifer_course.roofline.default_threads``), no download/loading progress bars in stored outputs,
    readable figure sizes. Returns what it set, for the record."""
    from minifer.bench.machine import default_threads

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


def check_prediction(prediction: float | None, measured: float, unit: str) -> str:
    """The "predict, then run" cells' verdict: the learner's number beside the measurement, as a ratio.

    Writing a number down before a measurement is what turns a table into a test of one's own model of the
    machine; a prediction left at ``None`` is not an error (the stored outputs are made that way), the cell
    then says what to write next time."""
    if prediction is None:
        return f"measured {measured:,.3g} {unit}; no prediction written (set it above, then run both cells again)"
    if prediction <= 0:
        return f"measured {measured:,.3g} {unit}; a prediction must be positive, got {prediction!r}"
    ratio = measured / prediction
    verdict = "within 2x of it" if 0.5 <= ratio <= 2 else ("far lower" if ratio < 0.5 else "far higher")
    return (f"you predicted {prediction:,.3g} {unit}, measured {measured:,.3g} {unit}: "
            f"{ratio:.2f}x your number ({verdict})")


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

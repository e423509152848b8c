"""The learner's engine, carried forward: the pieces written in the exercises, saved, graded and run inside ``LLM``.

Each exercise that rebuilds a piece of the engine ends by handing it to ``serve`` (a check cell): the piece's source is
saved to ``my_engine/<name>.py`` next to the notebook (so it survives a kernel restart and the next notebook finds it)
with the helpers, constants and imports it uses from the notebook, once a fresh process has run and graded that file
(``workbench_save``: a piece that works only inside its notebook is refused, naming what it misses), graded by the
exercise's own grader, then plugged into a real ``LLM`` through ``LLM(components=...)`` to serve the
chapter's workload, whose tokens must equal the reference engine's. The capstone loads every saved piece
(``load_pieces``) and runs them together; ``solution=True`` fills a missing or failing piece with minifer's own
(tiny-llm's ``--solution`` switch), so a learner who skipped an exercise can go on.

Each piece goes in through one of the seams vLLM has too (``minifer.engine.components.Components``: ``PIECES`` names
it), or is graded on its own (``rollback``: the engine has no seam for it). The small pieces of
chapter 00 and the EAGLE head's forward have the engine's own signatures and go in as layer classes: the engine builds
its model from a ``LlamaForCausalLM`` subclass made of the learner's classes (``model_class``), as vLLM builds an
out-of-tree model. The others' signatures are the textbook ones (one sequence, plain lists); the adapters below turn
each into its seam: a per-sequence ``paged_attention`` into an attention backend, the ``PrefixCachingAllocator``'s
bookkeeping into a ``KVBlockAllocator``, ``schedule_step``'s decisions into a ``SchedulerPolicy``, and so on. Grading
and serving are ``minifer_course.grading.engine``'s: a wrong piece fails its grader first, with the grader's hint,
before it ever reaches the engine.
"""

from __future__ import annotations

import functools
import inspect
import linecache
import os
import re
import statistics
import sys
import tempfile
import textwrap
import time
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from minifer import __version__
from minifer.attention.backends.paged import PagedKVCache
from minifer.core.kv_cache_manager import PrefixCacheStats, cdiv
from minifer.core.sched.scheduler import ScheduledBatch, Scheduler
from minifer.engine.components import Components
from minifer.engine.speculative import SpeculativeConfig
from minifer.layers.layernorm import RMSNorm
from minifer.layers.rotary_embedding import RotaryEmbedding
from minifer.models.llama import Attention, DecoderLayer, LlamaForCausalLM
from minifer.models.llama_eagle import EagleHead
from minifer.request import RequestStatus
from minifer.sample.rejection_sampler import RejectionVerifier
from minifer.sample.sampler import history_tensors, sample
from minifer.spec_decode.ngram_proposer import NgramProposer
from minifer_course.workbench_save import Carried, PieceRefused, carry, check_in_fresh_process
from minifer_course.workbench_spec import EAGLE_WORKLOAD
from minifer_course.workbench_step import pieces_for, scheduler_seam

FOLDER_ENV = "MINIFER_MY_ENGINE"  # overrides the folder (the tests use a temporary one)

# What a saved piece may use without importing it: the exercises' own imports. Annotations stay unevaluated, so
# a piece whose signature names a class of its notebook (``schedule_step``'s ``Request``) loads without it.
PRELUDE = """\
from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minifer.request import RequestStatus
"""


ON_ITS_OWN = "graded on its own"  # a piece the engine has no seam for: its grader is its whole check


@dataclass(frozen=True)
class Piece:
    """One piece the learner writes: where (``notebook``), the seam it fills (a ``Components`` field, or
    ``ON_ITS_OWN``) and how (``via``: the class of the model it goes into, for ``model_registry``). Its grader is
    ``minifer_course.grading``'s (``grading.engine.GRADERS``)."""

    name: str
    notebook: str
    seam: str
    via: str = ""

    @property
    def served(self) -> bool:
        return self.seam != ON_ITS_OWN


PIECES: dict[str, Piece] = {p.name: p for p in (
    Piece("rms_norm", "00_building_blocks", "model_registry", "LlamaForCausalLM.norm_cls (an RMSNorm subclass)"),
    Piece("rope_inv_freq", "00_building_blocks", "model_registry",
          "LlamaForCausalLM.rotary_cls (its _compute_inv_freq)"),
    Piece("apply_rotary", "00_building_blocks", "model_registry", "LlamaForCausalLM.attention_cls (its apply_rotary)"),
    Piece("top_p_mask", "00_building_blocks", "sampler"),
    Piece("decoder_layer", "00_building_blocks", "model_registry", "LlamaForCausalLM.layer_type (its forward)"),
    Piece("paged_attention", "02_kv_cache_and_paging", "attention_backend"),
    Piece("PrefixCachingAllocator", "02_kv_cache_and_paging", "block_allocator"),
    Piece("ForkingAllocator", "02_kv_cache_and_paging", "block_allocator"),
    Piece("schedule_step", "03_continuous_batching", "scheduler"),
    Piece("preempt", "03_continuous_batching", "scheduler"),
    Piece("update_from_output", "03_continuous_batching", "scheduler", "Scheduler.update_from_output"),
    Piece("verify_greedy", "04_speculative_decoding", "verifier"),
    Piece("rejection_sample", "04_speculative_decoding", "verifier"),
    Piece("ngram_propose", "04_speculative_decoding", "proposer"),
    Piece("rollback", "04_speculative_decoding", ON_ITS_OWN),
    Piece("eagle_forward", "04_speculative_decoding", "model_registry", "EagleHead (its forward)"),
)}

# The parameters of a piece whose signature changed when its seam did: a file saved before has other ones, and is
# refused (with what to re-save) rather than called with the wrong arguments.
SIGNATURES = {"decoder_layer": ("layer", "x", "cos", "sin", "attn")}

# --- saving and loading -------------------------------------------------------------------------------------


def folder(path: str | Path | None = None) -> Path:
    """``my_engine/`` in the working directory (the notebook's folder), or ``$MINIFER_MY_ENGINE``."""
    return Path(path or os.environ.get(FOLDER_ENV) or "my_engine")


def source_of(obj: Any) -> str:
    """The source of a function or class defined in a notebook cell. ``inspect.getsource`` finds a function's cell;
    a class defined in a notebook has no file, so its cell is found through one of its methods."""
    try:
        return textwrap.dedent(inspect.getsource(obj))
    except (TypeError, OSError):
        if not inspect.isclass(obj):
            raise
    for member in vars(obj).values():
        code = getattr(getattr(member, "__func__", member), "__code__", None)
        if code is None:
            continue
        lines = linecache.getlines(code.co_filename)
        for i, line in enumerate(lines):
            if line.lstrip().startswith(f"class {obj.__name__}"):
                return textwrap.dedent("".join(inspect.getblock(lines[i:])))
    raise OSError(f"cannot find the source of {obj.__name__}: define it in a cell and run that cell again")


def _globals_of(obj: Any) -> dict[str, Any]:
    """The namespace ``obj`` was defined in (the notebook's): where its helpers live."""
    if inspect.isclass(obj):
        obj = next((getattr(m, "__func__", m) for m in vars(obj).values() if hasattr(getattr(m, "__func__", m),
                                                                                  "__globals__")), None)
    return getattr(obj, "__globals__", {})


def save(*objs: Any, path: str | Path | None = None, name: str | None = None, grade: bool = False,
         prelude: str = PRELUDE, saved_by: str = "minifer_course.workbench.save") -> list[Path]:
    """Write each object's source to ``my_engine/<name>.py`` with everything it uses from the notebook (helpers,
    constants, imports: ``workbench_save.carry``), replacing what an earlier run saved; ``name`` (one object only):
    the exercise's name for it, when it was defined under another. The file is first run in a fresh process: one that
    does not run on its own (a helper it calls is missing) is refused with ``PieceRefused``, naming what it misses,
    and the earlier file stays. With ``grade``, it must also pass its checks there. Saving calls nothing in this
    process: an unfinished stub is saved too, and graded when it is used."""
    if name is not None and len(objs) != 1:
        raise ValueError("name= renames one object: save the others separately")
    out = folder(path)
    out.mkdir(parents=True, exist_ok=True)
    return [_save_one(obj, name or obj.__name__, out, grade, prelude, saved_by, set())[0] for obj in objs]


def _save_one(obj: Any, piece: str, out: Path, grade: bool, prelude: str, saved_by: str,
              saving: set[str]) -> tuple[Path, list[Path]]:
    """Save one piece (and first the pieces it builds on, saved as themselves); its file and the files it needs,
    in the order they run."""
    saving.add(piece)
    source = source_of(obj)
    carried = carry(obj, source, _globals_of(obj), prelude, set(PIECES) | set(_quant_pieces()), source_of)
    needs: list[Path] = []
    for other, value in carried.pieces.items():
        if other not in saving:
            file, before = _save_one(value, other, out, False, prelude, saved_by, saving)
            needs += [p for p in [*before, file] if p not in needs]
    alias = f"\n\n{piece} = {obj.__name__}\n" if obj.__name__ != piece else ""
    built_on = f"# it builds on the saved pieces: {', '.join(carried.pieces)}\n" if carried.pieces else ""
    text = (f"# {piece}: saved by {saved_by} for minifer {__version__}; the notebook's cell is the original.\n"
            f"{built_on}{prelude}\n\n{carried.text()}\n\n{source}{alias}").replace("\n\n\n\n\n", "\n\n\n")
    file = out / f"{piece}.py"
    with tempfile.TemporaryDirectory() as tmp:
        trial = Path(tmp) / file.name
        trial.write_text(text)
        problem = check_in_fresh_process(piece, trial, needs, grade)
    if problem is not None:
        raise PieceRefused(_refusal(piece, problem, carried, file))
    file.write_text(text)
    return file, needs


def _quant_pieces() -> dict[str, Any]:
    """Exercise 05's pieces (a piece may build on one of them), if its module is loaded."""
    module = sys.modules.get("minifer_course.workbench_quant")
    return getattr(module, "QUANT_PIECES", {})


def _refusal(piece: str, problem: str, carried: Carried, file: Path) -> str:
    why = next((f": {reason}" for missing, reason in carried.left_out.items() if repr(missing) in problem), "")
    if any(repr(missing) in problem for missing in carried.undefined):
        why = ": it is not defined in this notebook either (a typo, or a cell not run since a restart?)"
    kept = f" ({file} keeps what was saved before)" if file.is_file() else ""
    return (f"{piece} was not saved: its file does not run on its own, as the capstone runs it after a restart "
            f"({problem}{why}). Define what it uses in a cell of this notebook (a helper function, a constant, an "
            f"import) and run that cell and this one again{kept}")


def saved_for(file: Path) -> str:
    """The minifer version a saved file was written for (its first line), in words."""
    match = re.match(r"# \S+: saved by \S+ for minifer (\S+);", file.read_text().split("\n", 1)[0])
    return f"minifer {match.group(1)}" if match else "a course older than minifer 0.1.0"


def load_saved(path: str | Path | None = None, errors: dict[str, str] | None = None,
               names: Iterable[str] | None = None) -> dict[str, Any]:
    """Every saved piece (of ``names``, by default ``PIECES``), by name, each file run in its own namespace
    (``ForkingAllocator``'s file finds the saved ``PrefixCachingAllocator``, the class it extends). A file that does
    not run is left out, and why is put in ``errors``."""
    found: dict[str, Any] = {}
    root = folder(path)
    for name in names or PIECES:
        file = root / f"{name}.py"
        if not file.is_file():
            continue
        module = types.ModuleType(f"my_engine.{name}")  # a real module: dataclasses look their own one up
        module.__dict__.update(found)
        sys.modules[module.__name__] = module
        try:
            exec(compile(file.read_text(), str(file), "exec", dont_inherit=True), module.__dict__)
            piece = module.__dict__[name]
        except Exception as e:
            if errors is not None:
                errors[name] = _does_not_run(name, file, e)
            continue
        problem = outdated(name, piece, file)
        if problem is None:
            found[name] = piece
        elif errors is not None:
            errors[name] = problem
    return found


# minifer's modules and classes that took vLLM's names: a piece saved before imports or names one of them
RENAMED = {
    "minifer.engine.sequence": "minifer.request", "minifer.engine.block_manager": "minifer.core.kv_cache_manager",
    "minifer.engine.scheduler": "minifer.core.sched.scheduler", "minifer.engine.runner": "minifer.worker.model_runner",
    "minifer.sampling": "minifer.sampling_params / minifer.sample.sampler", "minifer.spec": "minifer.spec_decode",
    "minifer.layers.paged_attention": "minifer.attention.backends.paged", "minifer.quant": "minifer.quantization",
    "Sequence": "Request", "SequenceStatus": "RequestStatus", "SequenceGroup": "ParentRequest",
    "BlockManager": "KVCacheManager",
}


# Pieces an older exercise saved, that today's exercises replaced: the new piece -> the old file's name.
RETIRED = {"update_from_output": "engine_step"}


def retired(name: str, path: str | Path | None = None) -> str:
    """A note for a piece not saved yet when ``my_engine/`` holds the piece it replaced (an older exercise's)."""
    old = RETIRED.get(name)
    if old is None or not (folder(path) / f"{old}.py").is_file():
        return ""
    return (f"; {folder(path)}/{old}.py was saved by an older exercise and is not used: the engine step is "
            f"minifer's, and the part of it you write is now {name}")


def _does_not_run(name: str, file: Path, error: Exception) -> str:
    where = f"exercises/{PIECES[name].notebook}.ipynb" if name in PIECES else "its exercise"
    return (f"{name}: the saved {file} does not run ({type(error).__name__}: {error}){_moved(error)}; run its cell "
            f"in {where} again, which saves it again")


def _moved(error: Exception) -> str:
    """What a saved file that no longer runs was written against, when it names a module or class minifer renamed."""
    missing = getattr(error, "name", None) or ""
    old = next((o for o in sorted(RENAMED, key=len, reverse=True) if missing == o or missing.startswith(o + ".")),
               None)
    if old is None:
        return ""
    return f": it was saved before minifer took vLLM's names ({old} is now {RENAMED[old]}, docs/structure.md)"


def outdated(name: str, piece: Any, file: Path) -> str | None:
    """Why a saved piece cannot go into today's engine (it was saved for a seam that has changed), or None."""
    want = SIGNATURES.get(name)
    try:
        have = tuple(inspect.signature(piece).parameters)
    except (TypeError, ValueError):
        return None
    if want is None or have == want:
        return None
    return (f"{name}: the saved {file} takes ({', '.join(have)}), the signature of an older exercise (it was saved "
            f"for {saved_for(file)}; this is minifer {__version__}); {name} now "
            f"takes ({', '.join(want)}), as the engine's own does: rewrite it in "
            f"exercises/{PIECES[name].notebook}.ipynb and run its `in the engine` cell, which saves it again")


# --- the model, built from the learner's layer classes -------------------------------------------------------


def norm_class(rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]) -> type[RMSNorm]:
    """minifer's ``RMSNorm`` module, normalising with the learner's ``rms_norm`` (the function the module calls)."""

    class LearnersRMSNorm(RMSNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return rms_norm(x, self.weight, self.eps)

    return LearnersRMSNorm


def rotary_class(rope_inv_freq: Callable[[int, float], torch.Tensor]) -> type[RotaryEmbedding]:
    """minifer's ``RotaryEmbedding``, its table built from the learner's frequencies (no scaling: the exercise's
    ``rope_inv_freq(head_dim, theta)`` has none)."""

    class LearnersRotaryEmbedding(RotaryEmbedding):
        def _compute_inv_freq(self) -> torch.Tensor:
            if self.scaling:
                raise ValueError(f"this model scales RoPE ({self.scaling}); your rope_inv_freq(head_dim, theta) "
                                 "has no scaling")
            return rope_inv_freq(self.head_dim, self.theta).float()

    return LearnersRotaryEmbedding


def model_class(pieces: dict[str, Any]) -> type[LlamaForCausalLM] | None:
    """A ``LlamaForCausalLM`` built from the learner's layer classes (a piece not given stays minifer's), or None
    when none of chapter 00's model pieces is given. The learner's functions keep the engine's signatures, so each is
    a method or a function its class calls: ``decoder_layer`` is the layer's ``forward``, ``apply_rotary`` the
    attention's rotation."""
    p = pieces.get
    attrs: dict[str, Any] = {}
    if p("rms_norm"):
        attrs["norm_cls"] = norm_class(p("rms_norm"))
    if p("rope_inv_freq"):
        attrs["rotary_cls"] = rotary_class(p("rope_inv_freq"))
    if p("apply_rotary"):
        attrs["attention_cls"] = type("LearnersAttention", (Attention,), {"apply_rotary": staticmethod(p("apply_rotary"))})
    if p("decoder_layer"):
        attrs["layer_type"] = type("LearnersDecoderLayer", (DecoderLayer,), {"forward": p("decoder_layer")})
    return type("LearnersLlamaForCausalLM", (LlamaForCausalLM,), attrs) if attrs else None


def model_registry(pieces: dict[str, Any], method: str, architecture: str = "LlamaForCausalLM") -> dict[str, type] | None:
    """``Components.model_registry`` for these pieces: the learner's model for ``architecture`` (the target's), and,
    when the engine drafts with an EAGLE head (``method``), an ``EagleHead`` whose forward is the learner's."""
    registry: dict[str, type] = {}
    model = model_class(pieces)
    if model is not None:
        registry[architecture] = model
    if pieces.get("eagle_forward") and method == "eagle":
        registry["EagleHead"] = type("LearnersEagleHead", (EagleHead,), {"forward": pieces["eagle_forward"]})
    return registry or None


# --- adapters: the exercises' signatures -> the engine's seams -----------------------------------------------


def sampler_with_top_p(top_p_mask: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """A ``Sampler``: minifer's, with the learner's nucleus filter in place of ``apply_top_p``."""
    def sampler(seqs: list, logits: torch.Tensor):
        history = history_tensors(seqs, logits.shape[-1], logits.device)
        return sample(logits, [s.params for s in seqs], [s.generator for s in seqs], *history, top_p=top_p_mask)
    return sampler


def attention_backend_with(paged_attention: Callable[..., torch.Tensor]) -> type[PagedKVCache]:
    """A ``PagedAttentionBackend``: minifer's paged cache, whose attention runs the learner's function sequence by
    sequence (``paged_attention(q, k_cache, v_cache, block_table, context_len)`` for each one's new queries)."""

    class LearnersPagedAttention(PagedKVCache):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.use_triton = False  # every step goes through attend, on any device

        def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            meta = self.meta
            if self.calibrating or self.kv_cache_dtype != "auto":
                return super().attend(layer, q, k, v)
            hkv, d = k.shape[1], k.shape[2]
            self.k[layer].view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k)
            self.v[layer].view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v)
            outs, start = [], 0
            for i, n in enumerate(meta.query_lens):
                ctx = int(meta.context_lens[i])
                table = meta.block_tables[i, : -(-ctx // self.block_size)].tolist()
                outs.append(paged_attention(q[start : start + n], self.k[layer], self.v[layer], table, ctx))
                start += n
            return torch.cat(outs)

    return LearnersPagedAttention


def block_allocator_with(allocator_cls: type) -> Callable[[int, int, bool], Any]:
    """A ``KVBlockAllocator`` factory around the learner's ``PrefixCachingAllocator`` (or ``ForkingAllocator``):
    allocation, prefix lookups, registration, freeing, fork and copy-on-write are theirs; growing and shrinking a
    table (which the exercise does not ask for) take and release blocks through their ``take_free_block``."""

    def build(num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> LearnersAllocator:
        return LearnersAllocator(allocator_cls(num_blocks, block_size), num_blocks, enable_prefix_caching)

    return build


class LearnersAllocator:
    def __init__(self, mine: Any, num_blocks: int, enable_prefix_caching: bool) -> None:
        self.mine, self.num_blocks, self.block_size = mine, num_blocks, mine.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.mine.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.mine.cache)

    def block_table(self, seq_id: object) -> list[int]:
        return self.mine.tables[seq_id]

    def has_seq(self, seq_id: object) -> bool:
        return seq_id in self.mine.tables

    def can_allocate(self, token_ids: list[int], use_cache: bool = True) -> bool:
        if use_cache and self.enable_prefix_caching:
            return self.mine.can_allocate(token_ids)
        return cdiv(len(token_ids), self.block_size) <= self.num_free_blocks

    def allocate(self, seq_id: object, token_ids: list[int], use_cache: bool = True) -> int:
        if use_cache and self.enable_prefix_caching:
            cached = self.mine.allocate(seq_id, token_ids)
            self.prefix_cache_stats.queries += len(token_ids) // self.block_size
            self.prefix_cache_stats.hits += cached // self.block_size
            return cached
        self.mine.tables[seq_id], self.mine.seq_hashes[seq_id] = [], []
        self.append_slots(seq_id, len(token_ids))
        return 0

    def can_append(self, seq_id: object, num_tokens: int) -> bool:
        return cdiv(num_tokens, self.block_size) - len(self.mine.tables[seq_id]) <= self.num_free_blocks

    def append_slots(self, seq_id: object, num_tokens: int) -> None:
        table = self.mine.tables[seq_id]
        while len(table) < cdiv(num_tokens, self.block_size):
            table.append(self.mine.take_free_block())

    def truncate(self, seq_id: object, num_tokens: int) -> None:
        """Drop the blocks past ``num_tokens`` (rejected drafts), releasing each as the learner's ``free`` does."""
        mine, keep = self.mine, cdiv(num_tokens, self.block_size)
        table = mine.tables[seq_id]
        del mine.seq_hashes[seq_id][num_tokens // self.block_size:]
        while len(table) > keep:
            b = table.pop()
            mine.ref_count[b] -= 1
            if mine.ref_count[b] == 0:
                (mine.free_list.append(b) if mine.block_hash[b] is None else mine.evictable.__setitem__(b, None))

    def register_computed(self, seq_id: object, token_ids: list[int]) -> None:
        if self.enable_prefix_caching:
            self.mine.register_computed(seq_id, token_ids)

    def fork(self, parent_id: object, child_id: object) -> None:
        self._needs("fork")(parent_id, child_id)

    def copy_on_write(self, seq_id: object, position: int) -> tuple[int, int] | None:
        return self._needs("copy_on_write")(seq_id, position)

    def _needs(self, method: str) -> Callable[..., Any]:
        if not hasattr(self.mine, method):
            raise NotImplementedError(f"{method} is ForkingAllocator's (exercise 02, section 3c): save that class "
                                      f"to run requests whose completions share blocks (n > 1, beam search)")
        return getattr(self.mine, method)

    def free(self, seq_id: object) -> None:
        self.mine.free(seq_id)


class StepRequest:
    """A request as ``schedule_step`` sees it (the notebook's ``Request`` has the same fields)."""

    __slots__ = ("name", "num_tokens", "num_computed", "num_blocks")

    def __init__(self, name: str, num_tokens: int, num_computed: int = 0, num_blocks: int = 0) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "num_tokens", num_tokens)
        object.__setattr__(self, "num_computed", num_computed)
        object.__setattr__(self, "num_blocks", num_blocks)

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError("schedule_step must not modify its requests: return the plan instead")

    def __repr__(self) -> str:
        if not self.num_blocks and not self.num_computed:
            return f"{self.name}({self.num_tokens})"
        return f"{self.name}({self.num_tokens}, {self.num_computed}, {self.num_blocks})"


def scheduler_with(schedule_step: Callable[..., tuple[list[tuple[str, int]], list[str]]],
                   base: type[Scheduler] = Scheduler) -> type[Scheduler]:
    """A ``SchedulerPolicy``: each step describes the running and waiting sequences as the exercise's requests, asks
    the learner's ``schedule_step`` who runs and who is preempted, and carries that out on the allocator. A decision
    the allocator cannot honour (blocks that are not free) raises, naming the request."""

    class LearnersScheduler(base):
        def schedule(self) -> ScheduledBatch:
            blocks, cfg = self.blocks, self.config
            running = [StepRequest(s.request_id, s.num_tokens, s.num_computed_tokens,
                                   len(blocks.block_table(s.request_id))) for s in self.running]
            waiting = [StepRequest(s.request_id, len(s.all_token_ids)) for s in self.waiting]
            scheduled, preempted = schedule_step(running, waiting, blocks.num_free_blocks, blocks.block_size,
                                                 cfg.max_num_seqs, cfg.max_num_batched_tokens)
            batch = ScheduledBatch()
            by_id = {s.request_id: s for s in [*self.running, *self.waiting]}
            for name in preempted:  # victims, newest first: each is the newest still running when it goes
                if self.preempt_newest(batch).request_id != name:
                    raise RuntimeError(f"schedule_step preempted {name!r}, which is not the newest running request")
            for name, n in scheduled:
                seq = by_id[name]
                if seq.status is RequestStatus.RUNNING:
                    if not blocks.can_append(name, seq.num_computed_tokens + n):
                        raise RuntimeError(f"schedule_step ran {name!r} for {n} tokens, but the blocks it needs "
                                           "are not free")
                    blocks.append_slots(name, seq.num_computed_tokens + n)
                else:
                    if not blocks.can_allocate(seq.all_token_ids):
                        raise RuntimeError(f"schedule_step admitted {name!r}, but its prompt's blocks are not free")
                    self.waiting.remove(seq)
                    seq.num_computed_tokens = cached = blocks.allocate(name, seq.all_token_ids)
                    n = min(n, len(seq.all_token_ids) - cached)  # prefix-cache hits are not computed again
                    seq.status = RequestStatus.RUNNING
                    self.running.append(seq)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
            return batch

    return LearnersScheduler


def verifier_with(verify_greedy: Callable | None = None, rejection_sample: Callable | None = None) -> RejectionVerifier:
    """A ``Verifier``: the learner's ``verify_greedy`` as is (the exercise has the engine's signature) and their
    one-sequence ``rejection_sample`` applied row by row; a missing one stays minifer's."""

    class LearnersVerifier(RejectionVerifier):
        if verify_greedy is not None:
            greedy = staticmethod(verify_greedy)
        if rejection_sample is not None:
            @staticmethod
            def sample(draft_tokens, draft_probs, target_probs, generators):
                return [rejection_sample(list(d), draft_probs[i, : len(d)].float(), target_probs[i, : len(d) + 1].float(),
                                         generators[i]) for i, d in enumerate(draft_tokens)]

    return LearnersVerifier()


def proposer_with(ngram_propose: Callable[[list[int], int, int, int], list[int]], spec: dict[str, Any]) -> NgramProposer:
    """A ``DraftProposer``: prompt lookup through the learner's ``ngram_propose``."""

    class LearnersNgramProposer(NgramProposer):
        def lookup(self, seq, k: int) -> tuple[list[int], int]:
            tokens = list(ngram_propose(list(seq.all_token_ids), k, self.cfg.prompt_lookup_max,
                                        self.cfg.prompt_lookup_min))
            return tokens, 0  # the match length only tunes adaptive k, which the exercise leaves out

    return LearnersNgramProposer(SpeculativeConfig.from_dict(spec))


NGRAM_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
              "adaptive": False}


def components_from(pieces: dict[str, Any], spec: dict[str, Any] | None = None,
                    speculative: bool | None = None) -> Components:
    """The ``Components`` that run these pieces (by exercise name); a seam none of them fills stays minifer's, and a
    piece graded on its own (``ON_ITS_OWN``) is not run. The proposer and the EAGLE head apply to engines speculating
    with their method (``spec``, n-grams by default); ``speculative``: whether the engine speculates, when some pieces
    cannot apply (``workbench_step.pieces_for``)."""
    pieces = {n: piece for n, piece in pieces_for(pieces, speculative).items() if n not in PIECES or PIECES[n].served}
    p = pieces.get
    method = (spec or NGRAM_SPEC)["method"]
    alloc = p("ForkingAllocator") or p("PrefixCachingAllocator")
    verifier = None
    if p("verify_greedy") or p("rejection_sample"):
        verifier = verifier_with(p("verify_greedy"), p("rejection_sample"))
    return Components(
        sampler=sampler_with_top_p(p("top_p_mask")) if p("top_p_mask") else None,
        attention_backend=attention_backend_with(p("paged_attention")) if p("paged_attention") else None,
        block_allocator=block_allocator_with(alloc) if alloc else None,
        scheduler=scheduler_seam(pieces, scheduler_with),
        verifier=verifier,
        proposer=proposer_with(p("ngram_propose"), spec or NGRAM_SPEC) if p("ngram_propose") and method == "ngram" else None,
        model_registry=model_registry(pieces, method))


# --- the workloads the pieces serve, and their throughput ---------------------------------------------------

# Three prompts share a story opening longer than a KV block (16 tokens), so a prefix cache has something to find.
OPENING = "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun with her"
PROMPTS = [f"{OPENING} dog.", "The little dog ran to the park", "Tom and his mom went to the store. Tom wanted",
           f"{OPENING} best friend, Tom. One day", "One day, a big bird flew over the", "Ben had a red ball. He",
           f"{OPENING} mom. They", "The sun was hot and the cat"]


@dataclass(frozen=True)
class Workload:
    """Requests a piece serves: ``sampled`` requests draw with a seed each (the same draws in both engines), greedy
    ones are also compared with transformers; ``llm`` holds the engine options the chapter uses."""

    max_tokens: int = 16
    sampled: bool = False
    speculative: bool = False
    llm: tuple[tuple[str, Any], ...] = ()  # (option, value) pairs: a Workload is hashable, its tokens cached

    def params(self):
        from minifer import SamplingParams

        if self.sampled:
            return [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=self.max_tokens, seed=i, ignore_eos=True)
                    for i in range(len(PROMPTS))]
        return SamplingParams(temperature=0, max_tokens=self.max_tokens, ignore_eos=True)

    def options(self) -> dict[str, Any]:
        return {**dict(self.llm), **({"speculative_config": NGRAM_SPEC} if self.speculative else {})}

    def describe(self) -> str:
        kind = "sampled with a seed each" if self.sampled else "greedy"
        extra = ", n-gram speculation" if self.speculative else ""
        options = dict(self.llm)
        extra += f", a cache of {options['num_kv_blocks']} blocks" if "num_kv_blocks" in options else ""
        extra += f", {options['max_num_seqs']} at a time" if "max_num_seqs" in options else ""
        return f"{len(PROMPTS)} requests, {self.max_tokens} tokens each, {kind}{extra}"


# Each piece serves what its chapter is about: a small cache that forces preemption for the scheduler, shared
# prefixes for the allocator, seeded sampling for top-p and rejection sampling, speculation for the verifier.
WORKLOADS: dict[str, Workload] = {
    "rms_norm": Workload(), "rope_inv_freq": Workload(), "apply_rotary": Workload(), "decoder_layer": Workload(), "paged_attention": Workload(),
    "top_p_mask": Workload(sampled=True),
    "PrefixCachingAllocator": Workload(llm=(("max_num_seqs", 4),)), "ForkingAllocator": Workload(llm=(("max_num_seqs", 4),)),
    "schedule_step": Workload(max_tokens=32, llm=(("num_kv_blocks", 12), ("max_num_batched_tokens", 64))),
    "preempt": Workload(max_tokens=32, llm=(("num_kv_blocks", 12), ("max_num_batched_tokens", 64))),
    "update_from_output": Workload(max_tokens=32, llm=(("num_kv_blocks", 12), ("max_num_batched_tokens", 64))),
    "verify_greedy": Workload(speculative=True), "ngram_propose": Workload(speculative=True),
    "rejection_sample": Workload(sampled=True, speculative=True),
    "eagle_forward": EAGLE_WORKLOAD,  # minifer_course.workbench_spec
}
# The capstone: both kinds of requests, speculating, in a cache small enough to preempt, admitted a few at a time
# (so that later prompts find their prefixes cached), then a batch that preempts without speculating.
CAPSTONE = (Workload(speculative=True, llm=(("num_kv_blocks", 7), ("max_num_seqs", 4))),
            Workload(sampled=True, speculative=True, llm=(("num_kv_blocks", 7), ("max_num_seqs", 4))),
            WORKLOADS["schedule_step"])


@functools.lru_cache(maxsize=1)
def reference_llm(model: str = "tinystories-target"):
    """One loaded model for the whole notebook: every engine here shares its weights."""
    from minifer import LLM

    return LLM(model)


def engine(components=None, workload: Workload = Workload()):
    """An engine for ``workload`` with ``components``, on the reference's weights, or on weights of its own when the
    components build another model (the learner's layers: ``model_registry``)."""
    from minifer import LLM

    ref = reference_llm()
    own_model = components is not None and ref.model_config.architecture in (components.model_registry or {})
    return LLM("tinystories-target", share_weights_with=None if own_model else ref, components=components,
               **workload.options())


def tokens(llm, workload: Workload) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, workload.params(), use_tqdm=False)]



def throughput(components: Components, workload: Workload, rounds: int = 3) -> float:
    """Output tokens/s of an engine with ``components`` as a ratio of the reference engine's: rounds interleaved, each
    engine warmed up once first, the order alternating (reference first, then yours first) so that neither always
    runs in the other's wake; the median of the rounds' ratios."""
    return interleaved_ratio(engine(None, workload), engine(components, workload), lambda llm: tokens(llm, workload),
                             rounds)


def interleaved_ratio(ref: Any, mine: Any, run: Callable[[Any], list[list[int]]], rounds: int = 3) -> float:
    """``throughput``'s method for any two engines: ``run(engine)`` serves a batch and returns its tokens."""
    for llm in (mine, ref):  # yours first: a piece that does not run yet fails before the reference is timed
        run(llm)  # warm-up: first-call costs are not the engine's speed
    ratios = []
    for r in range(rounds):
        rates = {}
        for llm in ((ref, mine) if r % 2 == 0 else (mine, ref)):
            t0 = time.perf_counter()
            n = sum(len(t) for t in run(llm))
            rates[id(llm)] = n / (time.perf_counter() - t0)
        ratios.append(rates[id(mine)] / rates[id(ref)])
    return statistics.median(ratios)


def report_throughput(label: str, components: Callable[[], Components], workload: Workload, rounds: int = 3) -> float | None:
    """Print the ratio (a measurement for the learner's eyes, never asserted) and return it, or say why it was not
    measured."""
    return print_ratio(label, lambda: throughput(components(), workload, rounds), workload.describe(), rounds)


def print_ratio(label: str, measure: Callable[[], float], what: str, rounds: int,
                reference: str = "the reference engine's") -> float | None:
    """``report_throughput`` for any measurement: ``measure()`` returns the median ratio of ``rounds`` rounds of
    ``what``; an exception (a piece that does not run yet) is reported, not raised."""
    try:
        ratio = measure()
    except Exception as e:  # a piece that does not run yet: its check cell has already said why
        print(f"{label}: not measured ({type(e).__name__}: {str(e)[:120]}); its check cell above says what is missing")
        return None
    print(f"{label}: {ratio:.3g}x {reference} output tokens/s (median of {rounds} interleaved round"
          f"{'s' * (rounds != 1)} of {what}; measured on this machine now, not a check)")
    return ratio


def piece_throughput(name: str, piece: Any, rounds: int = 3) -> None:
    """The throughput cell after a piece's check: the engine with this one piece of yours against the reference."""
    spec = getattr(WORKLOADS[name], "speculative_config", None)
    report_throughput(f"your {name}", lambda: components_from({name: piece}, spec), WORKLOADS[name], rounds)

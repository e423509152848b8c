# Source of exercises/07_capstone.ipynb and solutions/07_capstone.ipynb.
# Edit this file, never the notebooks, then run `make exercises` (see exercises/README.md).

# %% [markdown]
# # Exercise 07 · Capstone: your engine serves a batch of requests
#
# Every exercise that rebuilt a piece of the engine ended with a cell that saved it to `my_engine/` (next to
# the notebooks) and ran it inside a real `LLM`, one piece at a time. Here all of them run **together**: the
# engine builds its model from your classes, so every layer runs your decoder layer, which normalises with your
# RMSNorm and rotates with your RoPE (your frequencies, your rotation); attention reads the paged cache through
# your `paged_attention`, your allocator hands out the blocks and finds cached prefixes, your `schedule_step`
# decides who runs at every step (and whom to preempt, which your `preempt` carries out), your n-gram proposer
# drafts, your verifier and rejection sampler decide which drafts stay, and your nucleus filter shapes the sampled
# tokens. Each goes in through one of the seams vLLM has too (`minifer/engine/components.py`); the two pieces the
# engine has no seam for, your engine step and your rollback, are graded again on their own.
#
# | piece | where you wrote it | seam (`Components` field) | where it first served requests |
# |---|---|---|---|
# | `rms_norm` | `00_building_blocks`, section 1 | `model_registry`: the model's `norm_cls` | its "now your RMSNorm serves" cell |
# | `rope_inv_freq` (RoPE's frequencies) | `00_building_blocks`, section 2a | `model_registry`: the model's `rotary_cls` | its "now your frequencies serve" cell |
# | `apply_rotary` (RoPE) | `00_building_blocks`, section 2b | `model_registry`: the model's `attention_cls` | its "now your RoPE serves" cell |
# | `top_p_mask` (in the sampler) | `00_building_blocks`, section 3 | `sampler` | its "now your nucleus filter serves" cell |
# | `decoder_layer` | `00_building_blocks`, section 4 | `model_registry`: the model's `layer_type` | its "now your decoder layer serves" cell |
# | `paged_attention` | `02_kv_cache_and_paging`, section 2 | `attention_backend` | its "now your paged attention serves" cell |
# | `PrefixCachingAllocator` / `ForkingAllocator` | `02_kv_cache_and_paging`, sections 3 and 3c | `block_allocator` | its "now your allocator serves" cell |
# | `schedule_step` | `03_continuous_batching`, section 1 | `scheduler` | its "now your scheduler step serves" cell |
# | `preempt` (preemption by recompute) | `03_continuous_batching`, section 2 | `scheduler` | its "now your preemption serves" cell |
# | `update_from_output` (after the forward pass) | `03_continuous_batching`, section 3 | `scheduler`: the scheduler's `update_from_output` | its "now your `update_from_output` serves" cell |
# | `verify_greedy` | `04_speculative_decoding`, section 1 | `verifier` | its "now your verifier serves" cell |
# | `rejection_sample` | `04_speculative_decoding`, section 2 | `verifier` | its "now your rejection sampler serves" cell |
# | `ngram_propose` | `04_speculative_decoding`, section 3 | `proposer` | its "now your n-gram proposer serves" cell |
# | `rollback` | `04_speculative_decoding`, section 5 | none: graded on its own | never (graded against minifer's rule) |
# | `eagle_forward` (the EAGLE head) | `04_speculative_decoding`, section 6 | `model_registry`: an `EagleHead` subclass | its "now your EAGLE head serves" cell; here, the fourth batch |
# | `quantize_int4_groupwise` | `05_quantization`, section 1 | none: applied to the loaded model before it serves | its "now your quantizer serves requests" cell; here, "Your int4 engine" |
# | `quantize_linears` (the load step) | `05_quantization`, section 2 | none: applied to the loaded model before it serves | its "now your load step serves requests" cell; here, "Your int4 engine" |
# | `int4_matmul` (the Triton kernel, or its PyTorch version on a machine without Triton) | `05_quantization`, section 3 (3b) | `quant_kernel` | its "now your kernel serves requests" cell; here, "Your int4 engine" |
#
# The check below loads each saved piece, grades it again with its exercise's checks, and builds
# `LLM("tinystories-target", components=...)` from them (`minifer_course.workbench.components_from` puts each piece
# behind its seam). It then serves two batches, one greedy and one sampled with a seed per request, both
# speculating, in a KV cache small enough that requests are preempted; a third, greedy and not speculating, in a
# cache so small that your scheduler preempts again and again; and a fourth, greedy, that drafts with your EAGLE
# head instead of your n-gram proposer (an engine has one drafter). The tokens must be the reference engine's,
# request by request (and transformers' for the greedy prompts).
#
# Skipped an exercise? Set `SOLUTION = True`: minifer's piece takes the place of any piece that is not saved
# or fails its checks (tiny-llm's `--solution` switch), and the cell after the check says which pieces ran.

# %%
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: your int4 kernel runs on the CPU

from minifer_course.common import setup_notebook

print(setup_notebook())  # CPU threads (one on a machine of two cores or fewer), quiet progress bars

# %% exercise-only
SOLUTION = False  # True: minifer's pieces fill the gaps

# %% solution-only
SOLUTION = True  # the solved twin runs whatever the solution notebooks saved, minifer's pieces filling any gap

# %% nbval-check-output
from minifer_course.grading.engine import check_capstone

check_capstone(solution=SOLUTION)

# %% [markdown]
# Whose pieces ran (`yours`, or minifer's and why):

# %%
from minifer_course.grading.engine import print_origins

print_origins()

# %% [markdown]
# ## How fast is your engine?
#
# Output tokens per second of your engine on the greedy batch, as a ratio of the reference engine's, measured in
# interleaved rounds on this machine (never a check: it varies from run to run). Expect well under 1x: your
# `paged_attention` loops over the sequences in Python where minifer's gathers a whole batch at once, and the
# textbook versions of the other pieces skip the engine's shortcuts. Which piece costs most? Each exercise's
# throughput cell measured one piece alone.

# %%
from minifer_course.grading.engine import capstone_throughput

capstone_throughput(solution=SOLUTION)

# %% [markdown]
# ## Your int4 engine
#
# Chapter 05's pieces change the weights themselves, so they run in an engine of their own,
# `LLM("tinystories-target", ...)`: your `quantize_int4_groupwise` makes the bytes, your `quantize_linears` swaps
# them into the loaded model before it serves, your `int4_matmul` (Triton or PyTorch) multiplies by them in every projection
# (`quant_kernel`) (`05_quantization`, sections 1, 2 and 3, each ending with its "now your ... serves requests"
# cell). int4 is not float32, so the reference is minifer's own int4 engine: the same greedy tokens, request by
# request, and teacher-forced log-probabilities equal up to float32 rounding. Without a GPU your kernel runs in
# Triton's interpreter, so the batch is small (4 requests of 8 tokens) and the cell takes a minute or so.
# `SOLUTION` works here too.

# %% nbval-check-output
from minifer_course.grading.quant_engine import check_int4_engine, print_int4_origins

check_int4_engine(solution=SOLUTION)

# %%
print_int4_origins()

# %% [markdown]
# Its speed as a ratio of minifer's int4 engine's, measured once (interleaved, never a check). Without a GPU it is
# tiny, and says more about the interpreter (every program of the grid run in numpy, one after another) than about
# your kernel; on a GPU the same cell compares two compiled kernels.

# %%
from minifer_course.grading.quant_engine import int4_throughput

ratio = int4_throughput(solution=SOLUTION)  # prints the ratio; `ratio` keeps its value

# %% [markdown]
# ## What is still minifer's
#
# The rest of the model's forward (`minifer/models/llama.py`: the embedding, the final norm, the logits), the
# weight loader, the model runner that packs a batch into tensors (`minifer/worker/model_runner.py`), the engine's step
# (`minifer/engine/core.py`, whose last line calls your `update_from_output`) and what surrounds it
# (`minifer/engine/llm_engine.py`: timing, outputs, speculation), the speculative loop around your verifier, with its
# rollback (`minifer/engine/speculative.py`), and the quantized layer itself (`QuantLinear`,
# `minifer/quantization/linear.py`). Reading them with your pieces in mind is the next step: each calls one of yours
# through a seam (`minifer/engine/components.py` lists them).

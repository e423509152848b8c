# Source of exercises/00_building_blocks.ipynb and solutions/00_building_blocks.ipynb.
# Edit this file, never the notebooks, then run `make exercises` (see exercises/README.md).

# %% [markdown]
# # Exercises 00 · Building blocks: RMSNorm, RoPE, nucleus sampling, the decoder layer
#
# Three small pieces that every Llama-family model and every sampler needs, rebuilt from scratch, then the
# layer they make:
#
# 1. **RMSNorm**, the normalisation in front of every attention and MLP block;
# 2. **RoPE**, the rotary position embedding that tells attention where each token sits;
# 3. **top-p (nucleus) filtering**, the sampler's cut of the unlikely tail;
# 4. **the decoder layer**, attention and MLP over the model's weights, with your RMSNorm and RoPE.
#
# Each piece then runs inside the real engine ("now your piece serves the chapter's workload"), and the
# capstone (`07_capstone`) runs all your pieces together. Your functions keep the signatures of minifer's own, so
# they drop in without adapters: RMSNorm, RoPE and the decoder layer go in as the model's layer classes (the engine
# builds its model from a `LlamaForCausalLM` subclass made of yours, as vLLM builds an out-of-tree model:
# `Components.model_registry`), the nucleus filter into the engine's sampler (`Components.sampler`).
#
# Each exercise explains the idea, gives a function whose body you write (replace the
# `raise NotImplementedError`), then a **check cell** that grades your function against minifer's own
# (`minifer/layers/layernorm.py`, `minifer/layers/rotary_embedding.py`, `minifer/sample/sampler.py`) on random inputs, odd
# shapes and edge cases. A check prints `ok` per passing check and stops at the first failure with what
# differs and a hint. The test suite runs the very same checks.

# %% [markdown] exercise-only
# Run the cells from the top. Stuck? The solved twin is
# [`solutions/00_building_blocks.ipynb`](../solutions/00_building_blocks.ipynb).

# %% [markdown] solution-only
# *This is the solved twin of [`exercises/00_building_blocks.ipynb`](../exercises/00_building_blocks.ipynb),
# generated from `exercises/source/00_building_blocks.py` by `make exercises`: edit the source, not
# this notebook.*

# %%
import torch

from minifer_course.common import setup_notebook

print(setup_notebook())  # CPU threads (one on a machine of two cores or fewer), quiet progress bars

# %% [markdown]
# ## 1 · RMSNorm
#
# A transformer adds every block's output to a running *residual stream*, whose scale drifts from layer to
# layer. Each attention and MLP block therefore first normalises its input. LayerNorm subtracts the mean
# and divides by the standard deviation; **RMSNorm** (Zhang & Sennrich, 2019) skips the mean and divides by
# the root mean square, which is cheaper and works as well. Llama, Qwen and Mistral all use it:
#
# $$\mathrm{RMSNorm}(x) = \frac{x}{\sqrt{\frac{1}{d}\sum_{i=1}^{d} x_i^2 + \varepsilon}} \odot w$$
#
# over the last dimension (the hidden size $d$), with a learned per-feature scale $w$. The small
# $\varepsilon$ (`1e-6` in Qwen3, `1e-5` in Llama 2) keeps an all-zero vector from dividing by zero.
#
# Models run in bfloat16, whose 8-bit mantissa is coarse, so the statistics are computed in float32 and
# the normalised result cast back to the input's dtype *before* the multiplication by $w$ (as Hugging
# Face transformers does, which is what makes minifer's outputs match it).

# %%
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise ``x`` by its root mean square over the last dimension, then scale by ``weight``.

    x: ``[..., hidden]`` in any float dtype; weight: ``[hidden]``; eps: added to the mean of squares.
    Returns a tensor of ``x``'s shape: computed in float32, cast back to ``x.dtype``, times ``weight``.
    """
    ### BEGIN SOLUTION
    x32 = x.float()  # a no-op (no copy) when x is already float32, so never modify x32 in place
    inv_rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * (x32 * inv_rms).to(x.dtype)
    ### END SOLUTION


# %% nbval-check-output
from minifer_course.grading.building_blocks import check_rms_norm

check_rms_norm(rms_norm)

# %% [markdown]
# ### Now your RMSNorm serves the chapter's workload
#
# The next cell saves your `rms_norm` to `my_engine/rms_norm.py` (next to this notebook, so it survives a kernel
# restart and the capstone finds it), grades it again, then plugs it into a real engine,
# `LLM("tinystories-target", components=...)`, which serves 8 greedy requests of 16 tokens. Seam: the model class
# (`Components.model_registry`); the engine builds its model with an `RMSNorm` subclass whose `forward` calls your
# function, `rms_norm(x, self.weight, self.eps)`, as minifer's module calls its own, so it normalises every layer's
# input (two per layer, and the final norm). Its tokens must be the reference engine's,
# request by request, and transformers' for the first two prompts. A piece that fails its checks never reaches
# the engine: the cell stops with the grader's hint instead.

# %% nbval-check-output
from minifer_course.grading.engine import check_in_engine

check_in_engine("rms_norm", rms_norm)

# %% [markdown]
# And its speed: output tokens per second of the engine with your piece, as a ratio of the reference engine's,
# measured in interleaved rounds on this machine (a measurement, not a check: it varies from run to run).

# %%
from minifer_course.workbench import piece_throughput

piece_throughput("rms_norm", rms_norm)

# %% [markdown]
# ## 2 · RoPE: rotary position embeddings
#
# Attention compares every query with every key by a dot product, which on its own ignores *where* the
# tokens are: "dog bites man" and "man bites dog" would look alike. **RoPE** (Su et al., 2021) encodes
# position by *rotating* queries and keys. Split a head's `head_dim` features into `head_dim/2` pairs;
# at position $m$, pair $i$ is rotated by the angle $m\,\theta_i$ with ($d$ = `head_dim`)
#
# $$\theta_i = \text{theta}^{-2i/d}, \qquad i = 0, \dots, d/2 - 1 .$$
#
# Pair 0 turns one radian per token, the last pair barely moves: a set of clocks running at geometric
# speeds (`theta` is 10 000 in Llama 2, 500 000 in Llama 3, 1 000 000 in Qwen). Since rotating $q$ by
# $m\theta$ and $k$ by $n\theta$ gives $(R_m q)\cdot(R_n k) = q \cdot R_{n-m}\,k$, the attention score
# depends only on the **distance** $m - n$, not on where the pair of tokens sits in the sequence.
#
# ### 2a · The frequencies
#
# Write `rope_inv_freq(head_dim, theta)`: the `head_dim // 2` values $\theta_i$ as a float32 tensor
# (minifer's version also handles the `linear` and `llama3` context-extension scalings; skip those).

# %%
def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """The rotation frequencies ``theta ** (-2i / head_dim)`` for ``i = 0 .. head_dim/2 - 1`` (float32)."""
    ### BEGIN SOLUTION
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # 2i / head_dim
    return 1.0 / (theta ** exponents)
    ### END SOLUTION


# %% nbval-check-output
from minifer_course.grading.building_blocks import check_rope_inv_freq

check_rope_inv_freq(rope_inv_freq)

# %% [markdown]
# ### Now your frequencies serve the chapter's workload
#
# The engine looks up `cos`/`sin` in a table its `RotaryEmbedding` computes once at load, from the frequencies
# its `_compute_inv_freq` returns (vLLM's name). Seam: the model class (`Components.model_registry`); the engine builds
# its model with a `RotaryEmbedding` subclass whose `_compute_inv_freq` returns your `rope_inv_freq(head_dim,
# theta)`, so the table (the same arithmetic) and every query and key of every layer turn at your speeds. The cell
# saves your function for the capstone, grades it again, serves 8 greedy requests and compares the tokens with the
# reference engine's and transformers'.

# %% nbval-check-output
from minifer_course.grading.engine import check_in_engine

check_in_engine("rope_inv_freq", rope_inv_freq)

# %% [markdown]
# ### 2b · Applying the rotation
#
# A pair $(a, b)$ rotated by $\varphi$ becomes $(a\cos\varphi - b\sin\varphi,\; b\cos\varphi + a\sin\varphi)$.
# Llama and Qwen use the **rotate-half** layout: feature $i$ is paired with feature $i + d/2$
# (not with its neighbour $i+1$, as in the original paper). With $x = [x_1, x_2]$ split into halves, the
# whole rotation is then one vectorised line:
#
# $$\mathrm{rope}(x) = x \odot \cos + \mathrm{rotate\_half}(x) \odot \sin, \qquad
# \mathrm{rotate\_half}(x) = [-x_2,\; x_1],$$
#
# where `cos` and `sin` hold each pair's angle twice, once per half. The engine precomputes them for every
# position once; for a batch of tokens it looks up one row per token, as this helper does:

# %%
def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` of shape ``[tokens, head_dim]`` for the given token positions."""
    angles = torch.outer(positions.float(), inv_freq)  # [tokens, head_dim/2]: m * theta_i
    both_halves = torch.cat((angles, angles), dim=-1)  # [tokens, head_dim]: a pair shares its angle
    return both_halves.cos(), both_halves.sin()


# %% [markdown]
# Write `apply_rotary(x, cos, sin)` for `x` of shape `[tokens, heads, head_dim]` (every head of a token is
# rotated by that token's angles) and `cos`/`sin` of shape `[tokens, head_dim]`.

# %%
def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[tokens, heads, head_dim]`` by per-token ``cos``/``sin`` ``[tokens, head_dim]``
    in the rotate-half layout. Returns a tensor of ``x``'s shape and dtype."""
    ### BEGIN SOLUTION
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over the heads
    return x * cos + rotated * sin
    ### END SOLUTION


# %% nbval-check-output
from minifer_course.grading.building_blocks import check_apply_rotary

check_apply_rotary(apply_rotary)

# %% [markdown]
# ### Now your RoPE serves the chapter's workload
#
# The next cell saves your `apply_rotary` to `my_engine/apply_rotary.py` (next to this notebook, so it survives a
# kernel restart and the capstone finds it), grades it again, then plugs it into a real engine, `LLM("tinystories-
# target", components=...)`, which serves 8 greedy requests of 16 tokens. Seam: the model class
# (`Components.model_registry`); the engine builds its model with an attention class whose `apply_rotary` is your
# function, so your rotation turns the queries and keys of every layer (`cos`/`sin` come from minifer's table here;
# the capstone pairs your rotation with your frequencies). Its tokens must be the reference engine's, request by
# request, and transformers' for the first two prompts. A piece that fails its checks never
# reaches the engine: the cell stops with the grader's hint instead.

# %% nbval-check-output
from minifer_course.grading.engine import check_in_engine

check_in_engine("apply_rotary", apply_rotary)

# %% [markdown]
# And its speed: output tokens per second of the engine with your piece, as a ratio of the reference engine's,
# measured in interleaved rounds on this machine (a measurement, not a check: it varies from run to run).

# %%
from minifer_course.workbench import piece_throughput

piece_throughput("apply_rotary", apply_rotary)

# %% [markdown]
# ## 3 · Top-p (nucleus) filtering
#
# Sampling from the model's full distribution now and then draws a token from the long tail of unlikely
# ones, and one bad token can derail the rest of the text. **Nucleus sampling** (Holtzman et al., 2019)
# samples only from the *nucleus*: the smallest set of most likely tokens whose probabilities sum to at
# least $p$. Unlike a fixed top-k, it adapts: when the model is sure, the nucleus holds a token or two;
# when many continuations are plausible, it holds many.
#
# Per row of logits: take the softmax, sort the probabilities in descending order and accumulate them. A
# token is kept when the probability of the tokens ranked **above** it is still below $p$, so the token
# that crosses $p$ is kept, and the most likely token always is. Every other token's logit becomes
# $-\infty$, so the softmax that follows gives it probability 0. Each row has its own $p$, because every
# request in a batch chooses its own sampling parameters. In minifer (`minifer/sample/sampler.py`) this step runs
# after the temperature and top-k and before min-p.
#
# Example: probabilities $(0.5, 0.25, 0.2, 0.05)$ and $p = 0.7$ keep the first two ($0.5 < 0.7$, then
# $0.75 \ge 0.7$); $p = 0.8$ keeps three.

# %%
def top_p_mask(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filtering of a batch of next-token logits.

    logits: ``[batch, vocab]`` float32; top_p: ``[batch]``, each in (0, 1].
    Returns the logits with every token outside its row's nucleus set to ``-inf``; kept tokens keep their
    logit. The nucleus is the smallest set of most likely tokens whose probabilities sum to >= p (the most
    likely token is always kept). Do not modify ``logits`` in place.
    """
    ### BEGIN SOLUTION
    probs = logits.softmax(dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs  # probability of the tokens ranked above
    drop_sorted = mass_above >= top_p[:, None]
    drop_sorted[:, 0] = False  # always keep the most likely token
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))
    ### END SOLUTION


# %% nbval-check-output
from minifer_course.grading.building_blocks import check_top_p

check_top_p(top_p_mask)

# %% [markdown]
# ### Now your nucleus filter serves the chapter's workload
#
# The next cell saves your `top_p_mask` to `my_engine/top_p_mask.py` (next to this notebook, so it survives a kernel
# restart and the capstone finds it), grades it again, then plugs it into a real engine,
# `LLM("tinystories-target", components=...)`, which serves 8 requests sampled at temperature 0.8 and top-p 0.9,
# each with its own seed. Seam: the sampler (`Components.sampler`, vLLM's `Sampler`); your filter runs inside
# minifer's sampler in place of `apply_top_p`, so the same seeds must draw the same tokens. Its tokens must be the reference engine's, request by request. A piece that fails its checks never
# reaches the engine: the cell stops with the grader's hint instead.

# %% nbval-check-output
from minifer_course.grading.engine import check_in_engine

check_in_engine("top_p_mask", top_p_mask)

# %% [markdown]
# And its speed: output tokens per second of the engine with your piece, as a ratio of the reference engine's,
# measured in interleaved rounds on this machine (a measurement, not a check: it varies from run to run).

# %%
from minifer_course.workbench import piece_throughput

piece_throughput("top_p_mask", top_p_mask)

# %% [markdown]
# ## 4 · The decoder layer, from the pieces
#
# With RMSNorm and RoPE written, a whole decoder layer is a page of code. Each of the model's layers is
#
# $$h = x + \mathrm{Attention}(\mathrm{RMSNorm}(x)), \qquad \mathrm{out} = h + \mathrm{MLP}(\mathrm{RMSNorm}(h)),$$
#
# the *residual stream* $x$ flowing through, each block adding its output to it. In minifer's layer
# (`minifer/models/llama.py`, the weights already loaded) the pieces are:
#
# * `layer.input_layernorm` and `layer.post_attention_layernorm`: RMSNorm modules (`.weight`, `.eps`);
# * `layer.self_attn.qkv_proj`: **one** linear layer for queries, keys and values (one big matmul runs faster
#   than three); split its output as `[q_size, kv_size, kv_size]` and view each part as
#   `[tokens, heads, head_dim]` (`num_heads` for queries, `num_kv_heads` for keys and values: grouped-query
#   attention). The sizes are attributes of the attention module: `att = layer.self_attn` has `att.q_size`
#   (`num_heads * head_dim`), `att.kv_size` (`num_kv_heads * head_dim`), `att.num_heads`, `att.num_kv_heads` and
#   `att.head_dim`;
# * Qwen3 only: `layer.self_attn.q_norm` / `k_norm` (not None), an RMSNorm over each head's `head_dim`, before RoPE;
# * RoPE on queries and keys, then `attn.attend(layer.self_attn.layer_idx, q, k, v)`: the attention backend
#   stores this step's keys and values in its KV cache and returns `[tokens, num_heads, head_dim]`;
# * `layer.self_attn.o_proj` on the attention output flattened back to `[tokens, q_size]`;
# * `layer.mlp.gate_up_proj`: gate and up projections fused; split at `intermediate_size`, then SwiGLU:
#   `down_proj(silu(gate) * up)`, where `mlp = layer.mlp` holds `mlp.intermediate_size`.
#
# Your function has the signature of `DecoderLayer.forward` (`layer` is its `self`), so it drops in as the layer's
# `forward`. Normalise and rotate with the layer's own modules (`layer.input_layernorm(x)`, `att.q_norm(q)`, ...,
# and `att.apply_rotary(q, cos, sin)`, the attention's rotation): they are minifer's here, and the ones you wrote in
# the capstone, where the engine builds the layer from your classes.

# %%
import torch.nn.functional as F


def decoder_layer(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
    """One decoder layer over ``layer``'s modules (``DecoderLayer.forward``'s signature): ``x`` ``[tokens, hidden]``
    (a batch's tokens, packed), per-token ``cos``/``sin`` ``[tokens, head_dim]``, the attention backend ``attn``.
    Returns ``[tokens, hidden]``. Do not modify ``x`` in place."""
    ### BEGIN SOLUTION
    att, mlp, n = layer.self_attn, layer.mlp, x.shape[0]
    h = layer.input_layernorm(x)
    q, k, v = att.qkv_proj(h).split([att.q_size, att.kv_size, att.kv_size], dim=-1)
    q = q.view(n, att.num_heads, att.head_dim)
    k = k.view(n, att.num_kv_heads, att.head_dim)
    v = v.view(n, att.num_kv_heads, att.head_dim)
    if att.q_norm is not None:  # Qwen3: normalise each head's query and key
        q, k = att.q_norm(q), att.k_norm(k)
    q, k = att.apply_rotary(q, cos, sin), att.apply_rotary(k, cos, sin)
    out = attn.attend(att.layer_idx, q, k, v)
    h = x + att.o_proj(out.reshape(n, att.q_size))  # a new tensor: x itself is left alone
    gate, up = mlp.gate_up_proj(layer.post_attention_layernorm(h)).split(mlp.intermediate_size, dim=-1)
    return h + mlp.down_proj(F.silu(gate) * up)
    ### END SOLUTION


# %% nbval-check-output
from minifer_course.grading.building_blocks import check_decoder_layer

check_decoder_layer(decoder_layer)

# %% [markdown]
# ### Now your decoder layer serves the chapter's workload
#
# The next cell saves your `decoder_layer` to `my_engine/decoder_layer.py` (next to this notebook, so it survives
# a kernel restart and the capstone finds it), grades it again, then plugs it into a real engine,
# `LLM("tinystories-target", components=...)`, which serves 8 greedy requests of 16 tokens. Seam: the model class
# (`Components.model_registry`; vLLM's `LlamaModel` takes its `layer_type` the same way); the engine builds its
# model with a `DecoderLayer` subclass whose `forward` is your function, so every layer of the model runs your
# forward over its own weights, normalising and rotating with minifer's modules. Its tokens must
# be the reference engine's, request by request, and transformers' for the first two prompts. A piece that fails
# its checks never reaches the engine: the cell stops with the grader's hint instead.

# %% nbval-check-output
from minifer_course.grading.engine import check_in_engine

check_in_engine("decoder_layer", decoder_layer)

# %% [markdown]
# And its speed: output tokens per second of the engine with your piece, as a ratio of the reference engine's,
# measured in interleaved rounds on this machine (a measurement, not a check: it varies from run to run).

# %%
from minifer_course.workbench import piece_throughput

piece_throughput("decoder_layer", decoder_layer)

# %% [markdown]
# ## Where these live in the engine
#
# * `rms_norm` is `minifer.layers.layernorm.rms_norm`, called twice per decoder layer and once at the end;
# * `rope_inv_freq` and `apply_rotary` are in `minifer/layers/rotary_embedding.py`; `RotaryEmbedding` precomputes
#   `cos`/`sin` for all positions, and the model rotates queries and keys right after their projection;
# * `top_p_mask` is `minifer.sample.sampler.apply_top_p`, one of the logits processors of `process_logits`;
# * `decoder_layer` is `minifer.models.llama.DecoderLayer.forward`, which `LlamaModel` calls once per layer;
# * the classes the model is built from are `LlamaForCausalLM`'s class attributes (`layer_type`, `attention_cls`,
#   `norm_cls`, `rotary_cls`): your pieces went in as a subclass naming yours, never as a branch in the forward.
#
# minifer's versions differ in details (`apply_top_p` sorts in *ascending* order and drops the tail whose
# mass stays below $1 - p$), yet the checks accept both, because they compare what the functions return.

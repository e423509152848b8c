"""Beam search over the paged cache (``beam_search.py``) against the oracle, HF transformers'
``generate(num_beams=w, early_stopping="never")``: the same finished sequences, in the same order, with the same
scores. Then what the paging must not change (block size, copy-on-write, prefix caching, an 8-bit cache,
prompts searched side by side or alone), the bookkeeping (no block leaks, even on an error) and the errors."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TINY_VOCAB, build_hf_model

import minifer
from minifer import BeamSearchParams, SamplingParams
from minifer.beam_search import BeamSearch, blocks_bound


def _first(eos: int | list[int]) -> int:
    return eos[0] if isinstance(eos, list) else eos


def hf_beams(hf_model, ids: list[int], w: int, max_tokens: int, length_penalty: float, eos: int | list[int] | None):
    """HF's finished beams: (prompt + output tokens, score), best first; padding after EOS stripped. ``eos`` is
    passed explicitly: it overrides the shared ``hf_target`` fixture's, which is off."""
    x = torch.tensor([ids])
    with torch.no_grad():
        g = hf_model.generate(x, attention_mask=torch.ones_like(x), num_beams=w, num_return_sequences=w,
                              early_stopping="never", length_penalty=length_penalty, max_new_tokens=max_tokens,
                              do_sample=False, output_scores=True, return_dict_in_generate=True,
                              eos_token_id=eos, pad_token_id=0 if eos is None else _first(eos), bos_token_id=None)
    beams = []
    ends = set([eos] if isinstance(eos, int) else eos or [])
    for row, score in zip(g.sequences.tolist(), g.sequences_scores.tolist()):
        out = row[len(ids):]
        end = next((i for i, t in enumerate(out) if t in ends), None)
        beams.append((ids + (out if end is None else out[: end + 1]), score))
    return beams


def assert_same_beams(output, reference) -> None:
    assert len(output.sequences) == len(reference)
    for rank, (seq, (tokens, score)) in enumerate(zip(output.sequences, reference)):
        assert seq.tokens == tokens, f"beam {rank} differs from HF's"
        assert seq.score == pytest.approx(score, rel=1e-4, abs=1e-5), f"beam {rank}'s score differs from HF's"


@pytest.fixture(scope="module")
def beam_llm():
    """The bundled target with 4-token blocks: beams split inside blocks all the time, so copy-on-write runs."""
    return minifer.LLM("tinystories-target", dtype="float32", device="cpu", block_size=4, max_num_seqs=16)


STORY_STARTS = ["Once upon a time, there was a little", "They all lived happily ever after. The",
                "Tom said sorry and they hugged. From that day on,"]


@pytest.mark.parametrize("w,length_penalty,max_tokens", [
    (4, 1.0, 200),  # long enough for stories to end: EOS finishes beams, and prunes the search
    (3, 1.5, 120),  # > 1 favours long beams: the bound uses max_tokens
    (2, 0.0, 60),  # ranked by the sum of log-probabilities
    (4, -0.5, 40),  # < 0 favours short beams
])
def test_bundled_target_matches_hf_beam_search(beam_llm, hf_target, w, length_penalty, max_tokens):
    eos = beam_llm.get_tokenizer().eos_token_id
    outputs = beam_llm.beam_search(STORY_STARTS, BeamSearchParams(w, max_tokens, length_penalty=length_penalty))
    reasons = set()
    for prompt, output in zip(STORY_STARTS, outputs):
        ids = beam_llm.get_tokenizer()(prompt)["input_ids"]
        assert_same_beams(output, hf_beams(hf_target, ids, w, max_tokens, length_penalty, eos))
        reasons |= {s.finish_reason for s in output.sequences}
        assert all(s.text.startswith(prompt) for s in output.sequences)  # vLLM's: the text holds the prompt
    if max_tokens == 200:  # two of the three stories end within 200 tokens; the second runs on
        assert "stop" in reasons, "this case is meant to finish beams on EOS"


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_tiny_checkpoints_match_hf_beam_search(kind, tiny_checkpoint):
    hf, folder = tiny_checkpoint(kind)
    llm = minifer.LLM(str(folder), dtype="float32", device="cpu", block_size=4)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, TINY_VOCAB, (n,), generator=gen).tolist() for n in (1, 6, 13)]
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(3, 24, ignore_eos=True))
    for ids, output in zip(prompts, outputs):
        assert_same_beams(output, hf_beams(hf, ids, 3, 24, 1.0, None))


def test_several_eos_ids_match_hf(tmp_path):
    """With several EOS ids, each beam's EOS continuations compete: the top (1 + #EOS) * w are kept (HF's rule)."""
    hf = build_hf_model("llama", seed=1)
    eos = list(range(10, 16))
    hf.config.eos_token_id = hf.generation_config.eos_token_id = eos
    hf.save_pretrained(tmp_path, safe_serialization=True)
    llm = minifer.LLM(str(tmp_path), dtype="float32", device="cpu", block_size=4)
    assert set(eos) <= llm.eos_token_ids
    gen = torch.Generator().manual_seed(0)
    stopped = 0
    for w, lp in ((2, 1.0), (3, 0.0), (5, 2.0)):
        ids = torch.randint(20, TINY_VOCAB, (7,), generator=gen).tolist()
        output = llm.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(w, 20, length_penalty=lp))[0]
        assert_same_beams(output, hf_beams(hf, ids, w, 20, lp, eos))
        stopped += sum(s.finish_reason == "stop" for s in output.sequences)
    assert stopped > 0, "no beam ended on one of the EOS ids: the case tests nothing"


def tokens_per_forward(llm, monkeypatch) -> list[int]:
    """A list that fills with the number of tokens of every forward ``llm``'s engine runs from now on."""
    sizes: list[int] = []
    forward = llm.engine.runner.forward

    def counting(ids, starts, chunks, num_logits):
        sizes.append(sum(map(len, chunks)))
        return forward(ids, starts, chunks, num_logits)

    monkeypatch.setattr(llm.engine.runner, "forward", counting)
    return sizes


def test_prefill_keeps_to_the_token_budget(monkeypatch):
    """Long prompts are prefilled in chunks of at most max_num_batched_tokens per step, as the scheduler does,
    and give the same beams; without chunked prefill a prompt over the budget is refused."""
    prompts = [[1] + list(range(30, 130)), [1] + list(range(200, 290))]
    params = BeamSearchParams(3, 12, ignore_eos=True)
    whole = minifer.LLM("tinystories-target", dtype="float32", device="cpu", block_size=4)
    small = minifer.LLM("tinystories-target", dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=32)
    sizes = tokens_per_forward(small, monkeypatch)
    chunked = small.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    assert max(sizes) <= 32 and sum(sizes[:3]) == 96  # the first steps are pure prefill, 32 tokens each
    assert tokens_of(chunked) == tokens_of(whole.beam_search([{"prompt_token_ids": p} for p in prompts], params))
    strict = minifer.LLM("tinystories-target", dtype="float32", device="cpu", max_num_batched_tokens=32,
                         enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="prompt 0 has 101 tokens, more than max_num_batched_tokens=32"):
        strict.beam_search([{"prompt_token_ids": prompts[0]}], params)


def test_beam_width_one_is_greedy(beam_llm):
    prompts = STORY_STARTS
    greedy = beam_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    beams = beam_llm.beam_search(prompts, BeamSearchParams(1, 48, ignore_eos=True))
    for g, b in zip(greedy, beams):
        assert b.sequences[0].tokens == g.prompt_token_ids + g.outputs[0].token_ids
        assert b.sequences[0].cum_logprob == pytest.approx(sum(
            next(iter(lp.values())).logprob for lp in b.sequences[0].logprobs), abs=1e-4)


def test_logprobs_and_fields(beam_llm):
    out = beam_llm.beam_search(["The cat"], BeamSearchParams(3, 12, ignore_eos=True))[0]
    scores = [s.score for s in out.sequences]
    assert scores == sorted(scores, reverse=True)
    for seq in out.sequences:
        assert len(seq.logprobs) == 12 and seq.finish_reason == "length" and seq.stop_reason is None
        output = seq.tokens[-12:]
        assert [next(iter(d)) for d in seq.logprobs] == output
        assert seq.cum_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(seq.logprobs, output)), abs=1e-4)
        assert seq.score == pytest.approx(seq.cum_logprob / 12, rel=1e-6)
        assert all(d[t].rank >= 1 for d, t in zip(seq.logprobs, output))


def run_search(llm, prompts, params, **kw):
    search = BeamSearch(llm.engine, params, llm.eos_token_ids, llm.tokenizer, llm.max_model_len, **kw)
    return search.run(prompts), search.stats


def tokens_of(outputs):
    return [[s.tokens for s in o.sequences] for o in outputs]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_paging_does_not_change_the_beams(kv_cache_dtype):
    """One block per token never shares a partly filled block (nothing to copy); 3- and 16-token blocks copy on
    almost every fork. With an 8-bit cache the copies must carry the per-token scales too."""
    results, copies = [], []
    params = BeamSearchParams(4, 40, ignore_eos=True)
    for block_size, caching in ((1, True), (3, True), (16, True), (3, False)):
        llm = minifer.LLM("tinystories-target", dtype="float32", device="cpu", block_size=block_size,
                          enable_prefix_caching=caching, kv_cache_dtype=kv_cache_dtype)
        outputs, stats = run_search(llm, [llm.tokenizer(p)["input_ids"] for p in STORY_STARTS], params)
        results.append(tokens_of(outputs))
        copies.append(stats.block_copies)
    assert all(r == results[0] for r in results[1:])
    assert copies[0] == 0 and min(copies[1:]) > 0


def test_prompts_side_by_side_equal_prompts_alone(beam_llm):
    prompts = [beam_llm.tokenizer(p)["input_ids"] for p in STORY_STARTS]
    params = BeamSearchParams(3, 30, ignore_eos=True)
    together, _ = run_search(beam_llm, prompts, params)
    alone = [run_search(beam_llm, [p], params)[0][0] for p in prompts]
    assert tokens_of(together) == tokens_of(alone)
    # a batch of 3 sequences admits one prompt at a time
    one_by_one, stats = run_search(beam_llm, prompts, params, max_num_seqs=3)
    assert tokens_of(one_by_one) == tokens_of(alone)
    assert stats.steps == 3 * 30


def test_blocks_are_shared_counted_and_all_returned(beam_llm, monkeypatch):
    blocks = beam_llm.engine.kv_cache_manager
    checked = []
    step = BeamSearch._step

    def checked_step(self, active):
        step(self, active)
        blocks.check_invariants()
        held = {b.seq_id for s in active for b in s.beams if not s.done}
        assert held == {i for s in active for i in s.held}, "a live beam without blocks, or blocks without a beam"
        checked.append(len(held))

    monkeypatch.setattr(BeamSearch, "_step", checked_step)
    prompt = beam_llm.tokenizer(STORY_STARTS[0])["input_ids"]
    _, stats = run_search(beam_llm, [prompt], BeamSearchParams(4, 30, ignore_eos=True))
    assert len(checked) == 30 and max(checked) == 4
    assert not blocks._seqs and blocks.num_free_blocks == blocks.num_blocks
    assert 0 < stats.block_copies <= stats.forks
    assert stats.peak_blocks <= blocks_bound(len(prompt), 30, 4, blocks.block_size)
    assert stats.peak_blocks < stats.peak_blocks_unshared and 0 < stats.memory_saving < 1
    assert stats.kv_tokens_copied <= stats.block_copies * (blocks.block_size - 1)
    assert stats.kv_tokens_copied < stats.kv_tokens_reordered


def test_an_error_mid_search_returns_every_block(beam_llm, monkeypatch):
    blocks = beam_llm.engine.kv_cache_manager
    calls = {"n": 0}
    forward = beam_llm.engine.runner.forward

    def failing(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("injected failure")
        return forward(*args, **kw)

    monkeypatch.setattr(beam_llm.engine.runner, "forward", failing)
    with pytest.raises(RuntimeError, match="injected"):
        beam_llm.beam_search(STORY_STARTS, BeamSearchParams(3, 20, ignore_eos=True))
    monkeypatch.undo()
    assert not blocks._seqs and blocks.num_free_blocks == blocks.num_blocks
    assert beam_llm.beam_search(["The cat"], BeamSearchParams(2, 4))[0].sequences  # and it still works


def test_small_cache_searches_in_waves():
    llm = minifer.LLM("tinystories-target", dtype="float32", device="cpu", block_size=4, num_kv_blocks=40)
    prompts = [llm.tokenizer(p)["input_ids"] for p in STORY_STARTS]
    params = BeamSearchParams(3, 24, ignore_eos=True)
    assert all(blocks_bound(len(p), 24, 3, 4) <= 40 < 2 * blocks_bound(len(p), 24, 3, 4) for p in prompts)
    outputs, stats = run_search(llm, prompts, params)
    assert stats.steps == 3 * 24  # one prompt at a time
    assert stats.peak_blocks <= 40
    big = minifer.LLM("tinystories-target", dtype="float32", device="cpu", block_size=4)
    assert tokens_of(outputs) == tokens_of(run_search(big, prompts, params)[0])


def test_bad_requests_are_refused_naming_the_problem(beam_llm):
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(0, 8)
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(True, 8)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(2, 0)
    with pytest.raises(ValueError, match="temperature must be 0"):
        BeamSearchParams(2, 8, temperature=0.7)
    with pytest.raises(ValueError, match="length_penalty"):
        BeamSearchParams(2, 8, length_penalty=math.nan)
    with pytest.raises(TypeError, match="BeamSearchParams"):
        beam_llm.beam_search(["x"], SamplingParams())
    with pytest.raises(ValueError, match="prompt 1"):
        beam_llm.beam_search(["fine", {"prompt_token_ids": []}], BeamSearchParams(2, 4))  # "" is its BOS token
    with pytest.raises(ValueError, match="prompt 0 has 1024 tokens"):
        beam_llm.beam_search([{"prompt_token_ids": [5] * 1024}], BeamSearchParams(2, 4))
    small = minifer.LLM("tinystories-target", dtype="float32", device="cpu", block_size=4, num_kv_blocks=10)
    with pytest.raises(ValueError, match=r"prompt 0: 8 beams .* need \d+ KV blocks .* the cache has 10"):
        small.beam_search(["Once upon a time"], BeamSearchParams(8, 64))
    assert small.engine.kv_cache_manager.num_free_blocks == 10
    static = minifer.LLM("tinystories-target", dtype="float32", device="cpu", batching="static")
    with pytest.raises(ValueError, match="batching='continuous'"):
        static.beam_search(["x"], BeamSearchParams(2, 4))


def test_refuses_to_share_a_busy_engine(beam_llm):
    engine = beam_llm.engine
    engine.add_request("busy", "Once upon a time", SamplingParams(max_tokens=4))
    try:
        with pytest.raises(RuntimeError, match="running requests"):
            beam_llm.beam_search(["x"], BeamSearchParams(2, 4))
    finally:
        engine.abort_request("busy")
    assert beam_llm.beam_search(["x"], BeamSearchParams(2, 4))[0].sequences


def test_max_model_len_caps_the_output():
    llm = minifer.LLM("tinystories-target", dtype="float32", device="cpu", block_size=4, max_model_len=20)
    prompt = llm.tokenizer("Once upon a time, there was a")["input_ids"]
    out = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(2, 100, ignore_eos=True))[0]
    assert all(len(s.tokens) == 20 and s.finish_reason == "length" for s in out.sequences)


def test_notebook_comparison_with_transformers(beam_llm, monkeypatch):
    from minifer_course.ch00_generation import compare_beam_search_with_transformers

    params = BeamSearchParams(3, 16)
    report = compare_beam_search_with_transformers(beam_llm, STORY_STARTS[:2], params)
    assert report.endswith("6 of 6 finished beams identical, every score within 1e-4 of transformers': True")
    search = minifer.LLM.beam_search

    def reversed_beams(self, prompts, p):  # a wrong ranking must show
        outs = search(self, prompts, p)
        for o in outs:
            o.sequences.reverse()
        return outs

    monkeypatch.setattr(minifer.LLM, "beam_search", reversed_beams)
    report = compare_beam_search_with_transformers(beam_llm, STORY_STARTS[:2], params)
    assert "2 of 6 finished beams identical" in report and report.endswith("False")

    def first_only(self, prompts, p):  # a missing beam must show too
        outs = search(self, prompts, p)
        for o in outs:
            del o.sequences[1:]
        return outs

    monkeypatch.setattr(minifer.LLM, "beam_search", first_only)
    assert "2 of 6 finished beams identical" in compare_beam_search_with_transformers(beam_llm, STORY_STARTS[:2],
                                                                                      params)


def test_beams_decode_within_the_token_budget_when_they_can(monkeypatch):
    """With a budget of 8 tokens, two 3-beam searches would need 6 decode rows each: one runs at a time."""
    llm = minifer.LLM("tinystories-target", dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=8)
    sizes = tokens_per_forward(llm, monkeypatch)
    out = llm.beam_search(["Once upon a time", "Tom had a ball"], BeamSearchParams(3, 6, ignore_eos=True))
    assert max(sizes) <= 8 and all(len(o.sequences) == 3 for o in out)


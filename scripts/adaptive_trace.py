"""Trace of the adaptive-k controller with the draft model: per round, its speedup over plain decoding, the steps by k,
the acceptance estimate and the predicted speedup at 16 sequences for k = 1..5; at the end, every speculative step
taken at 12 or more sequences with the speedup the controller measured for it (``realized``).

    OMP_NUM_THREADS=1 taskset -c 0 python scripts/adaptive_trace.py

Batches of 1, 4, 8 and then 16 sequences, 64 tokens, the steps of a plain and an adaptive engine interleaved
(``run_interleaved``), as in the speculative benchmark.
"""
import torch
from collections import Counter
torch.set_num_threads(1)
from minifer.bench.speculative import _engine, DRAFT, story_openings, run_interleaved
from minifer.sampling_params import SamplingParams
plain = _engine("tinystories-target", None, 32, None)
ad = _engine("tinystories-target", {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 5, "adaptive": True}, 32, None, plain)
engines = {"plain": plain, "adaptive": ad}
prompts = story_openings(32)
params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
ctl = ad.engine.speculator.adaptive
# log every speculative step's realized value at b >= 16 with b
orig = ctl.observe_realized
log = []
def obs(r):
    orig(r)
    if r.decodes >= 12 and r.speculated:
        d = ctl.realized.get(r.decodes.bit_length(), ())
        log.append((r.decodes, r.k, round(d[-1], 3) if len(d) else None))
ctl.observe_realized = obs
for b, rounds in ((1, 1), (4, 1), (8, 4), (16, 8)):
    batches = [[prompts[(j * b + i) % 32] for i in range(b)] for j in range(max(1, 8 // b))]
    for r in range(rounds):
        before = Counter(ad.engine.speculator.stats.k_counts)
        spent = dict.fromkeys(engines, 0.0)
        for batch in batches:
            s, _ = run_interleaved(engines, batch, params, seed=r)
            for m in s: spent[m] += s[m]
        ks = ad.engine.speculator.stats.k_counts - before
        a = ctl.alpha_estimate()
        base = ctl.predicted_rate(16, 0, a)
        print(b, r, "speedup", round(spent["plain"] / spent["adaptive"], 3), "ks", dict(ks), "alpha", round(a, 3),
              "pred@16", [round(ctl.predicted_rate(16, k, a, 1.0) / base, 3) for k in range(1, 6)], flush=True)
print("spec steps at b>=12 (b, k, realized):", log)

"""lm-evaluation-harness's ``local-completions`` against minifer's server, its tokenizer found through
``/tokenizer_info`` (``tokenizer_backend="remote"``), and its log-likelihoods set beside minifer's own.

    pip install "lm-eval[api]"    # not a course dependency
    python scripts/lmeval_remote_tokenizer.py

No dataset is downloaded: two loglikelihood requests are built by hand, as a task would build them.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

PORT = 8765
PAIRS = [("Once upon a time, there was a little", " girl"), ("Tom and his dog went to the", " park")]


def minifer_loglikelihoods() -> list[float]:
    """The same continuations scored by the engine directly (context and continuation encoded apart, no BOS, as
    lm-eval's remote tokenizer does)."""
    from minifer import LLM, SamplingParams

    llm = LLM("tinystories-target")
    tok, out = llm.get_tokenizer(), []
    for ctx, cont in PAIRS:
        c, k = tok.encode(ctx, add_special_tokens=False), tok.encode(cont, add_special_tokens=False)
        res = llm.generate([{"prompt_token_ids": c + k}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
        out.append(sum(d[t].logprob for d, t in zip(res.prompt_logprobs[len(c):], k)))
    return out


def main() -> None:
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    srv = subprocess.Popen([sys.executable, "-m", "minifer", "serve", "tinystories-target", "--port", str(PORT)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=1)
                break
            except OSError:
                time.sleep(1)
        lm = LocalCompletionsAPI(model="tinystories-target", base_url=f"http://127.0.0.1:{PORT}/v1/completions",
                                 tokenizer_backend="remote", tokenized_requests=True, num_concurrent=1)
        print("tokenizer:", type(lm.tokenizer).__name__, "eos", repr(lm.tokenizer.eos_token))
        served = [ll for ll, _ in lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(PAIRS)])]
    finally:
        srv.terminate()
        srv.wait(timeout=30)
    for (ctx, cont), a, b in zip(PAIRS, served, minifer_loglikelihoods()):
        print(f"{cont!r} after {ctx!r}: lm-eval {a:.6f}, minifer direct {b:.6f}")


if __name__ == "__main__":
    main()

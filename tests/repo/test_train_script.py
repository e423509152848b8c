"""The pair-training script still runs (smoke mode), and the shipped pair is as good as its record says."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import MODELS_DIR, REPO, minifer_forward

import minifer
from minifer import SamplingParams

SUMMARY_KEYS = {"target_heldout_loss", "draft_heldout_loss", "target_minus_draft", "target_gap", "draft_agreement_k4"}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pair")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "train_pair.py"), "--smoke", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"train_pair.py --smoke failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return out


@pytest.mark.slow
def test_smoke_training_produces_loadable_pair(smoke_run):
    for name in ("tinystories-target", "tinystories-draft"):
        folder = smoke_run / name
        for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "training.json"):
            assert (folder / f).is_file(), f"{name}/{f} missing"
        llm = minifer.LLM(str(folder), dtype="float32", device="cpu")
        assert llm.model_config.vocab_size == len(llm.get_tokenizer()) == 2048
        out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 5 and out.finish_reason == "length"
    assert not (smoke_run / "_tokenizer").exists(), "the temporary tokenizer folder is cleaned up"


@pytest.mark.slow
def test_smoke_training_report(smoke_run):
    report = json.loads((smoke_run / "train_report.json").read_text())
    assert {"target", "draft", "draft_agreement_k4", "samples", "summary"} <= report.keys()
    summary = report["summary"]
    assert SUMMARY_KEYS <= summary.keys()
    for key in ("target_heldout_loss", "draft_heldout_loss"):
        assert isinstance(summary[key], float) and 0 < summary[key] < 10, key
    assert isinstance(summary["target_gap"], float)
    assert summary["target_minus_draft"] == pytest.approx(summary["target_heldout_loss"] - summary["draft_heldout_loss"],
                                                          abs=1e-3)
    assert 0 <= summary["draft_agreement_k4"] <= 4
    assert len(report["samples"]) == 3


# --- the shipped pair -------------------------------------------------------------------------------


def test_shipped_training_record_claims_quality():
    """Checks the *record* (train_report.json) of the shipped pair, not the weights themselves."""
    summary = json.loads((MODELS_DIR / "train_report.json").read_text())["summary"]
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["target_heldout_loss"] <= summary["draft_heldout_loss"] - 0.1
    assert summary["target_gap"] <= 0.3


def heldout_loss(llm, stories, max_len=512) -> float:
    """Mean next-token cross-entropy over ``<eot> story <eot>`` sequences (the training format)."""
    tok = llm.get_tokenizer()
    total, count = 0.0, 0
    for story in stories:
        ids = (tok(story)["input_ids"] + [tok.eos_token_id])[:max_len]
        assert ids[0] == tok.bos_token_id
        logits = minifer_forward(llm, ids)
        total += float(F.cross_entropy(logits[:-1].double(), torch.tensor(ids[1:]), reduction="sum"))
        count += len(ids) - 1
    return total / count


def test_shipped_target_beats_draft_on_heldout(target_llm, draft_llm, heldout_stories):
    """Recomputed with minifer on held-out stories the pair never trained on."""
    stories = heldout_stories[:20]
    target, draft = heldout_loss(target_llm, stories), heldout_loss(draft_llm, stories)
    assert target <= draft - 0.05, (target, draft)
    # both are trained language models (a uniform guess over 2048 tokens scores ln 2048 = 7.6) and agree
    # with the recorded held-out losses to within the slice's sampling noise
    recorded = json.loads((MODELS_DIR / "train_report.json").read_text())["summary"]
    assert abs(target - recorded["target_heldout_loss"]) < 0.5
    assert abs(draft - recorded["draft_heldout_loss"]) < 0.5


# --- the repair of the target's BOS row (scripts/repair_bos_row.py) ---------------------------------


@pytest.mark.slow
def test_bos_row_repair_trains_that_row_alone(tmp_path):
    """On a copy of the pair whose target has the old defect put back (its <eot> row zeroed), a smoke run
    trains that row, and the first token after BOS alone is no longer a uniform guess."""
    import shutil

    from safetensors.torch import load_file, save_file

    for name in ("tinystories-target", "tinystories-draft"):
        shutil.copytree(MODELS_DIR / name, tmp_path / name)
    weights = tmp_path / "tinystories-target" / "model.safetensors"
    state = load_file(weights)
    state["model.embed_tokens.weight"][0] = 0
    save_file(state, weights, metadata={"format": "pt"})
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "repair_bos_row.py"), "--smoke", "--models",
                           str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"repair_bos_row.py --smoke failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    after = load_file(weights)
    assert after["model.embed_tokens.weight"][0].abs().sum() > 0
    assert after.keys() == state.keys() and all(after[k].shape == v.shape for k, v in state.items())
    record = json.loads((tmp_path / "tinystories-target" / "training.json").read_text())["bos_row_repair"]
    assert record["before"]["first_token_loss"] > record["after"]["first_token_loss"]
    assert set(record["bars"]) == {"heldout_not_worse", "gap_at_most_0.3", "target_0.1_nats_better_than_draft",
                                   "draft_agreement_not_lower", "first_token_learned"}


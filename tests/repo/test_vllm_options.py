"""minifer's option names against vLLM's, recorded as data (references/vllm_options.json, with the vLLM source
and commit each list came from). An option minifer adds, renames or drops must either carry vLLM's name or be
named in the file's ``minifer_differs`` with what vLLM calls it (or why it has no counterpart); and the
docs/vllm.md (moving to vLLM) must name every one that differs."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minifer import LLM, SamplingParams
from minifer.engine.arg_utils import EngineArgs
from minifer.engine.speculative import SpeculativeConfig
from minifer.sampling_params import BeamSearchParams

ROOT = Path(__file__).resolve().parents[2]
DATA = json.loads((ROOT / "references" / "vllm_options.json").read_text())
VLLM = {group: set(v["names"]) for group, v in DATA["vllm"].items()}
DIFFERS = DATA["minifer_differs"]


def llm_options() -> set[str]:
    """What ``LLM`` takes by name: its named parameters and, through ``**kwargs``, every ``EngineArgs`` field."""
    named = set(inspect.signature(LLM.__init__).parameters) - {"self", "kwargs"}
    return named | {f.name for f in dataclasses.fields(EngineArgs)}


def serve_options() -> set[str]:
    out = subprocess.run([sys.executable, "-m", "minifer", "serve", "--help"], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    return {f.replace("-", "_") for f in re.findall(r"--([a-z][a-z-]+)", out)} - {"help"}


def test_the_recorded_lists_name_their_source():
    for group, v in DATA["vllm"].items():
        assert v["source"].startswith("vllm/") and len(v["names"]) == len(set(v["names"])) > 3, group


@pytest.mark.parametrize("group,options", [
    ("LLM", llm_options),
    ("SamplingParams", lambda: {f.name for f in dataclasses.fields(SamplingParams)}),
    ("BeamSearchParams", lambda: {f.name for f in dataclasses.fields(BeamSearchParams)}),
    ("SpeculativeConfig", lambda: {f.name for f in dataclasses.fields(SpeculativeConfig)}),
])
def test_every_option_has_vllms_name_or_says_how_it_differs(group, options):
    vllm = VLLM["EngineArgs"] if group == "LLM" else VLLM[group]
    ours = options()
    unexplained = ours - vllm - set(DIFFERS[group])
    assert not unexplained, f"{group}: {sorted(unexplained)} are not vLLM's names; add them to minifer_differs"
    stale = set(DIFFERS[group]) - ours
    assert not stale, f"{group}: minifer_differs names {sorted(stale)}, which minifer no longer has"
    same_name = set(DIFFERS[group]) & vllm
    assert not same_name, f"{group}: {sorted(same_name)} are vLLM's names too; they need no entry"
    for name, says in DIFFERS[group].items():  # a counterpart must be a vLLM option; otherwise say "none"
        counterpart = says.split()[0]
        assert counterpart.rstrip(":") == "none" or counterpart in vllm, (group, name, says)


def test_serve_flags_are_vllm_serve_flags():
    flags = serve_options() - {"model"}
    assert {"port", "host", "max_num_seqs", "speculative_config"} <= flags
    unexplained = flags - VLLM["EngineArgs"] - VLLM["FrontendArgs"] - set(DIFFERS["serve"])
    assert not unexplained, f"serve: {sorted(unexplained)} are not vllm serve's flags; add them to minifer_differs"


def test_speculative_methods_are_vllms():
    import minifer.engine.speculative as spec

    methods = set(spec.METHODS)
    assert methods == {"draft_model", "ngram", "eagle"}, methods  # a new method must be added here on purpose
    assert methods <= set(DATA["vllm"]["SpeculativeConfig"]["methods"])


def test_readme_maps_every_difference():
    section = (ROOT / "docs" / "vllm.md").read_text()
    for group in ("LLM", "SpeculativeConfig", "values"):
        for name in DIFFERS[group]:
            assert f"`{name}`" in section, f"docs/vllm.md does not name {group}.{name}"
    assert "references/vllm_options.json" in section

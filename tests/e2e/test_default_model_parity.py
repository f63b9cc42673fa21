"""The real default model (SmolLM2-135M-Instruct, imported from its GGUF): exl3 vs transformers
loading the same imported folder. fp32 logits on a 200-token text within 1e-4, and the same 48
greedy tokens for a chat prompt (exl3 through its paged Generator)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from smol_gguf import imported_model  # noqa: E402

from exl3_core import Cache, Config, Generator, Model, Tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def models():
    from transformers import AutoModelForCausalLM

    d = imported_model()
    torch.set_num_threads(1)  # tiny per-op work on a shared 2-core machine: threads only contend
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    cfg = Config.from_directory(d)
    ours = Model.from_config(cfg)
    ours.load("cpu", dtype=torch.float32)
    return ref, ours, Tokenizer.from_config(cfg)


def _text_200_tokens(tok: Tokenizer) -> torch.Tensor:
    import pydoc_data.topics as t

    text = t.topics["with"] + t.topics["for"]
    ids = tok.encode(text)
    assert ids.shape[1] >= 200
    return ids[:, :200]


def test_logits_match_transformers_fp32(models) -> None:
    ref, ours, tok = models
    ids = _text_200_tokens(tok)
    with torch.no_grad():
        want = ref(ids).logits
    got = ours.forward(ids)
    rel = ((got - want).abs().max() / want.abs().max()).item()
    assert rel < 1e-4, f"max|Δ|/max|ref| = {rel:.3g}"


def test_same_48_greedy_tokens_for_a_chat_prompt(models) -> None:
    ref, ours, tok = models
    messages = [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}]
    prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_bos=False)
    with torch.no_grad():
        want = ref.generate(prompt, max_new_tokens=48, min_new_tokens=48, do_sample=False)[0, prompt.shape[1]:]
    gen = Generator(model=ours, cache=Cache(ours, max_num_tokens=1024), tokenizer=tok)
    from exl3_core import Job

    job = Job(prompt, max_new_tokens=48, stop_at_eos=False)
    gen.enqueue(job)
    got: list[int] = []
    while gen.num_remaining():
        for r in gen.iterate():
            got += r["token_ids"]
    assert got == want.tolist(), (tok.decode(torch.tensor(got)), tok.decode(want))

"""The real default model (SmolLM2-135M-Instruct, imported from its GGUF) with a random rank-8 LoRA on all seven
projections: exl3 against transformers + PEFT loading the same folders, fp32 logits within 1e-4, and the same
greedy tokens through exl3's generator."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from smol_gguf import imported_model

from exl3_core import Cache, Config, Generator, Job, Model
from exl3_core.testing.arch import rel_err
from exl3_core.testing.lora import peft_adapter

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM

    d = imported_model()
    torch.set_num_threads(1)  # tiny per-op work on a shared 2-core machine: threads only contend
    folder = tmp_path_factory.mktemp("smol_lora")
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ref = peft_adapter(hf, folder, r=8, alpha=16.0, seed=7)
    ours = Model.from_config(Config.from_directory(d))
    ours.load("cpu", dtype=torch.float32)
    ours.load_lora(folder, name="smol")
    return ref, ours, folder


def test_logits_match_transformers_peft_fp32(models) -> None:
    ref, ours, _ = models
    ids = torch.randint(0, 49152, (1, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(ids).logits
        with ref.disable_adapter():
            base = ref(ids).logits
    assert rel_err(want, base) > 0.02, "the random adapter barely changes the logits: the test would be vacuous"
    assert rel_err(ours.forward(ids, loras={"smol": 1.0}), want) < 1e-4
    assert rel_err(ours.forward(ids), base) < 1e-4


def test_same_greedy_tokens_through_the_generator(models) -> None:
    ref, ours, _ = models
    prompt = torch.randint(0, 49152, (1, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ref.generate(input_ids=prompt, max_new_tokens=10, min_new_tokens=10, do_sample=False)[0, 24:]
    gen = Generator(model=ours, cache=Cache(ours, max_num_tokens=512))
    job = Job(prompt, max_new_tokens=10, stop_at_eos=False, loras={"smol": 1.0})
    gen.enqueue(job)
    toks: list[int] = []
    while gen.num_remaining():
        for r in gen.iterate():
            toks += r["token_ids"]
    assert toks == want.tolist()


def test_generate_command_applies_the_adapter(models, capsys: pytest.CaptureFixture[str]) -> None:
    """``exl3 generate --lora DIR:WEIGHT`` prints what the generator gives a job with that adapter and weight."""
    from exl3_core import Tokenizer
    from exl3_core.cli import main

    _, ours, folder = models
    prompt = "The tide came in and"
    tok = Tokenizer.from_config(ours.config)
    gen = Generator(model=ours, cache=Cache(ours, max_num_tokens=512), tokenizer=tok)
    want = gen.generate(prompt, max_new_tokens=8, loras={"smol": 0.5})
    assert want != gen.generate(prompt, max_new_tokens=8), "weight 0.5 changes nothing here"
    rc = main(["generate", prompt, "-m", str(ours.config.directory), "--device", "cpu", "--raw", "--max-new-tokens",
               "8", "--greedy", "--lora", f"{folder}:0.5"])
    out = capsys.readouterr().out
    assert rc == 0 and out == want + "\n"
    rc = main(["generate", prompt, "-m", str(ours.config.directory), "--device", "cpu", "--lora", str(folder / "nope")])
    assert rc == 1 and "nope" in capsys.readouterr().err

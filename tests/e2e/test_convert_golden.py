"""exl3's converter side by side with ExLlamaV3 on the golden HF models.

Quality: plain ``exl3 convert -b B`` (no other option: the built-in corpus calibration sized for the
model and the post-pass scale refit) must be no worse than ExLlamaV3's conversion on both metrics of
``golden_quality.py``: the 128 golden positions of ``stats.json`` and 4096 held-out positions. The CI
case is model_c at 3.0 bpw, one seed; ``pytest -m slow`` runs every golden bitrate of model_a and
model_c at three calibration seeds, prints each seed's figures and asserts the means.

Format: the checkpoint has exactly the tensor names, shapes, dtypes and config keys of ExLlamaV3's own
conversion, and reads back (through Model/EXL3Linear) to the very Ŵ the quantizer produced.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

from golden_quality import GOLDEN, golden_kl, heldout_kl, reference_engine_kl

from exl3_core import __version__
from exl3_core.archkit import Model
from exl3_core.convert.pipeline import convert
from exl3_core.loader import SafetensorsCollection
from exl3_core.quant.exl3 import codebook_from_tensors, decode_inner, reconstruct
from exl3_core.quant.exl3.linear import EXL3Linear

SLOW = [("model_a", 2.0), ("model_a", 3.0), ("model_a", 4.0), ("model_c", 2.5), ("model_c", 3.0), ("model_c", 5.0),
        ("model_c", 8.0)]
SEEDS = (0, 1, 2)


def _convert(model: str, bpw: float, out: Path, captured: dict[str, Any] | None = None, **over: Any) -> Path:
    convert(GOLDEN / "hf" / model, out, bpw, progress=False, report=lambda s: None,
            on_quantized=None if captured is None else captured.__setitem__, **over)
    return out


def _scores(model: str, bpw: float, outs: list[Path]) -> None:
    """Print every conversion's KL on both metrics and assert their means are at most ExLlamaV3's."""
    ref_g, ref_h = reference_engine_kl(model, bpw)
    gs, hs = [], []
    for i, out in enumerate(outs):
        g, top1 = golden_kl(out, model)
        h = heldout_kl(out, model)
        gs.append(g)
        hs.append(h)
        print(f"{model} {bpw} bpw conversion {i}: golden KL {g:.5f} (top-1 {top1:.3f}), held-out KL {h:.5f}")
    theirs = f"ExLlamaV3 {ref_g:.5f} / {ref_h:.5f}" if ref_g is not None else "ExLlamaV3: no figure"
    print(f"{model} {bpw} bpw mean of {len(outs)}: golden {statistics.mean(gs):.5f}, held-out "
          f"{statistics.mean(hs):.5f} | {theirs}")
    if ref_g is not None and ref_h is not None:
        assert statistics.mean(gs) <= ref_g, f"{model} at {bpw} bpw: golden KL {gs} (mean) > ExLlamaV3's {ref_g:.5f}"
        assert statistics.mean(hs) <= ref_h, f"{model} at {bpw} bpw: held-out KL {hs} (mean) > ExLlamaV3's " \
                                             f"{ref_h:.5f}"


@pytest.fixture(scope="module")
def model_c_3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    captured: dict[str, Any] = {}
    out = _convert("model_c", 3.0, tmp_path_factory.mktemp("golden") / "model_c_3.0", captured)
    return out, captured


def test_kl_no_worse_than_reference_engine(model_c_3: tuple[Path, dict[str, Any]]) -> None:
    _scores("model_c", 3.0, [model_c_3[0]])


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bpw"), SLOW)
def test_kl_no_worse_than_reference_engine_all(model: str, bpw: float, tmp_path: Path) -> None:
    _scores(model, bpw, [_convert(model, bpw, tmp_path / f"seed{s}", seed=s) for s in SEEDS])


def _quant_config(d: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    qc = json.loads((d / "quantization_config.json").read_text())
    return qc, qc.pop("tensor_storage")


def test_structure_matches_reference_checkpoint(model_c_3: tuple[Path, dict[str, Any]]) -> None:
    out, _ = model_c_3
    gold = GOLDEN / "exl3" / "model_c_exl3_3.0bpw_mul1"
    with SafetensorsCollection(out) as ours, SafetensorsCollection(gold) as theirs:
        assert sorted(ours.keys()) == sorted(theirs.keys())
        for n in theirs:
            assert (ours.shape(n), ours.dtype(n)) == (theirs.shape(n), theirs.dtype(n)), n
        assert ours.get_tensor("model.layers.0.mlp.down_proj.mul1").item() == \
            theirs.get_tensor("model.layers.0.mlp.down_proj.mul1").item()
        assert all(ours.metadata(f) is None for f in ours.files)
    cfg, gcfg = json.loads((out / "config.json").read_text()), json.loads((gold / "config.json").read_text())
    assert list(cfg) == list(gcfg)
    assert list(cfg["quantization_config"]) == list(gcfg["quantization_config"])
    calibration = cfg["quantization_config"]["calibration"]  # the default size chosen for the model
    assert calibration["rows"] * calibration["cols"] >= 32768
    assert cfg["quantization_config"] == {**gcfg["quantization_config"], "version": __version__,
                                          "calibration": calibration}
    qc, storage = _quant_config(out)
    gqc, gstorage = _quant_config(gold)
    assert qc == cfg["quantization_config"] and list(qc) == list(gqc)
    assert sorted(storage) == sorted(gstorage)
    for key, entry in gstorage.items():
        assert storage[key] == entry, key  # same tensors, shapes, byte counts, dtype strings, K, multiplier
    src = {p.name for p in (GOLDEN / "hf" / "model_c").iterdir()} - {"model.safetensors"}
    assert src | {"model.safetensors", "quantization_config.json"} == {p.name for p in out.iterdir()}


def test_checkpoint_reads_back_quantizer_w(model_c_3: tuple[Path, dict[str, Any]]) -> None:
    # the post-pass moves only the fp16 scales: the stored trellis is the quantizer's bit for bit, the
    # checkpoint reads back to the quantizer's own Ŵ under the stored scales, and the quantizer's Ŵ (before
    # the post-pass, which aims at the output rather than the weights) is about as close to W as ExLlamaV3's
    out, captured = model_c_3
    with SafetensorsCollection(out) as stored:
        scales = {key: (stored.get_tensor(f"{key}.suh"), stored.get_tensor(f"{key}.svh")) for key in captured}
        for key, q in captured.items():
            assert torch.equal(stored.get_tensor(f"{key}.trellis"), q.trellis), key
    stored_q = {key: dataclasses.replace(q, suh=scales[key][0], svh=scales[key][1]) for key, q in captured.items()}
    model = Model.from_pretrained(out)
    layers = {m.key: m for m in model.modules() if isinstance(m, EXL3Linear)}
    assert sorted(layers) == sorted(captured)
    hf = load_file(GOLDEN / "hf" / "model_c" / "model.safetensors")
    gold = load_file(GOLDEN / "exl3" / "model_c_exl3_3.0bpw_mul1" / "model.safetensors")
    ratios = {}
    for key, q in captured.items():
        lin = layers[key]
        assert torch.equal(lin.inner(), decode_inner(q.trellis, q.K, q.codebook)), key
        assert torch.equal(lin.dequantize(), stored_q[key].dequantize().T), key
        w = hf.get(f"{key}.weight", hf["model.embed_tokens.weight"]).float()  # tied head: the embedding
        ours = float((q.dequantize() - w).pow(2).sum() / w.pow(2).sum())
        wg = reconstruct(gold[f"{key}.trellis"], gold[f"{key}.suh"], gold[f"{key}.svh"], None,
                         codebook_from_tensors(gold, key))[: w.shape[1], : w.shape[0]].T
        ratios[key] = ours / float((wg - w).pow(2).sum() / w.pow(2).sum())
    print("weight NMSE, exl3 / ExLlamaV3: " + ", ".join(f"{k.split('.', 2)[-1]} {r:.3f}" for k, r in ratios.items()))
    assert max(ratios.values()) < 1.25, ratios

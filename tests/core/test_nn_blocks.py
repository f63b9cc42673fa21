"""Linear factory (dense / EXL3 / padding / errors), RMSNorm and activations against references."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from exl3_core.loader import SafetensorsCollection
from exl3_core.nn import DenseLinear, WeightError, make_linear, rms_norm
from exl3_core.nn.mlp import ACTIVATIONS, activation
from exl3_core.quant.exl3.linear import EXL3Linear


def source(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> SafetensorsCollection:
    save_file(tensors, tmp_path / "model.safetensors")
    return SafetensorsCollection(tmp_path)


def test_dense_trims_128_padding(tmp_path: Path) -> None:
    w, b = torch.randn(72, 100), torch.randn(72)
    wp = torch.zeros(128, 128)
    wp[:72, :100] = w
    bp = torch.zeros(128)
    bp[:72] = b
    src = source(tmp_path, {"p.weight": wp, "p.bias": bp})
    lin = make_linear("p", 100, 72, bias=None, source=src, device="cpu", dtype=torch.float32)
    assert isinstance(lin, DenseLinear) and tuple(lin.weight.shape) == (72, 100)
    x = torch.randn(5, 100)
    torch.testing.assert_close(lin(x), F.linear(x, w, b))


def test_bias_policy(tmp_path: Path) -> None:
    w, b = torch.randn(8, 16), torch.randn(8)
    src = source(tmp_path, {"with.weight": w, "with.bias": b, "without.weight": w.clone()})
    x = torch.randn(3, 16)
    kw = {"source": src, "device": "cpu", "dtype": torch.float32}
    torch.testing.assert_close(make_linear("with", 16, 8, bias=None, **kw)(x), F.linear(x, w, b))
    torch.testing.assert_close(make_linear("with", 16, 8, bias=False, **kw)(x), F.linear(x, w))
    with pytest.raises(WeightError, match=r"without\.bias"):
        make_linear("without", 16, 8, bias=True, **kw)


def test_errors_name_tensor_and_file(tmp_path: Path) -> None:
    src = source(tmp_path, {"a.weight": torch.randn(8, 17), "half.trellis": torch.zeros(1, 1, 32, dtype=torch.int16)})
    kw = {"bias": None, "source": src, "device": "cpu", "dtype": torch.float32}
    with pytest.raises(WeightError, match=r"'a\.weight'.*model\.safetensors.*\[8, 17\].*\[8, 16\]"):
        make_linear("a", 16, 8, **kw)
    with pytest.raises(WeightError, match=r"'missing\.weight'.*" + str(tmp_path).replace("/", ".")):
        make_linear("missing", 16, 8, **kw)
    with pytest.raises(WeightError, match=r"half\.trellis.*neither EXL3"):
        make_linear("half", 128, 128, **kw)


def test_exl3_storage_is_picked(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    k, n, K = 128, 128, 2
    t = {
        "q.trellis": torch.randint(-32768, 32767, (k // 16, n // 16, 16 * K), generator=g, dtype=torch.int16),
        "q.suh": (torch.randn(k, generator=g) * 0.1).half(),
        "q.svh": (torch.randn(n, generator=g) * 0.1).half(),
    }
    src = source(tmp_path, t)
    lin = make_linear("q", 100, 72, bias=None, source=src, device="cpu", dtype=torch.float32)
    assert isinstance(lin, EXL3Linear)
    ref = EXL3Linear.from_tensors("q", lambda name: t.get(name), 100, 72)
    x = torch.randn(4, 100, generator=g)
    torch.testing.assert_close(lin(x), ref(x))


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_formula(offset: float, dtype: torch.dtype) -> None:
    x = torch.randn(6, 3, 40).to(dtype)
    w = torch.randn(40)
    got = rms_norm(x, w, 1e-5, offset)
    xd = x.double()
    want = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * (w.double() + offset)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(got.double(), want.to(dtype).double(), rtol=tol, atol=1e-5)


def test_activations_match_transformers() -> None:
    act2fn = pytest.importorskip("transformers.activations").ACT2FN
    x = torch.linspace(-6, 6, 301)
    for name in ACTIVATIONS:
        torch.testing.assert_close(activation(name)(x), act2fn[name](x), rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="hidden_act='nope'"):
        activation("nope")

"""exl3_core.loader: reading HF-written checkpoints, corruption handling, all-or-nothing loads,
the sharded writer, and the progress reporter.

Oracles: the state_dict of a random transformers model (what was saved), and the reference
``safetensors`` reader for files we write.
"""
from __future__ import annotations

import gc
import io
import json
import re
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from exl3_core import settings
from exl3_core.loader import (
    INDEX_FILE,
    SINGLE_FILE,
    LoaderError,
    SafetensorsCollection,
    TensorRequest,
    load_tensors,
    save_sharded,
    save_tensors,
)
from exl3_core.progress import Progress

transformers = pytest.importorskip("transformers")


def _tiny_model(tie: bool, seed: int) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    model = _tiny_model(tie=True, seed=1234)
    d = tmp_path_factory.mktemp("sharded")
    model.save_pretrained(d, max_shard_size="200KB")
    return d, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    model = _tiny_model(tie=False, seed=4321)
    d = tmp_path_factory.mktemp("single")
    model.save_pretrained(d)
    return d, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def sharded_copy(sharded: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(sharded[0], dst)
    return dst


def _shards(d: Path) -> list[Path]:
    return sorted(d.glob("model-*.safetensors"))


def _header_bytes(path: Path) -> tuple[int, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return n, raw[8 : 8 + n]


def _check_all_equal(coll: SafetensorsCollection, sd: dict[str, torch.Tensor]) -> None:
    assert len(coll) > 0
    for name in coll.keys():
        t = coll.get_tensor(name)
        assert coll.shape(name) == tuple(sd[name].shape)
        assert coll.dtype(name) == sd[name].dtype
        assert torch.equal(t, sd[name]), name
    # Keys HF did not save must be tied aliases of saved ones (same storage in the live model).
    saved_ptrs = {sd[n].untyped_storage().data_ptr() for n in coll.keys()}
    for name in set(sd) - set(coll.keys()):
        assert sd[name].untyped_storage().data_ptr() in saved_ptrs, f"{name} neither saved nor tied"


# -- reading what transformers wrote ---------------------------------------------------------------


def test_sharded_checkpoint_loads_identical(sharded: tuple[Path, dict[str, torch.Tensor]]) -> None:
    d, _ = sharded
    model_sd = _tiny_model(tie=True, seed=1234).state_dict()  # rebuilt: tied lm_head shares storage
    index = json.loads((d / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1, "fixture should produce several shards"
    with SafetensorsCollection(d) as coll:
        assert set(coll.keys()) == set(index["weight_map"])
        assert sorted(coll.files) == _shards(d)
        for name, fname in index["weight_map"].items():
            assert coll.file_of(name) == d / fname
        assert coll.total_bytes() == sum(t.numel() * t.element_size() for t in
                                         (coll.get_tensor(n) for n in coll.keys()))
        _check_all_equal(coll, model_sd)
        assert "lm_head.weight" in model_sd and "lm_head.weight" not in coll


def test_single_file_loads_identical(single: tuple[Path, dict[str, torch.Tensor]]) -> None:
    d, sd = single
    assert (d / SINGLE_FILE).is_file() and not (d / INDEX_FILE).exists()
    with SafetensorsCollection(d) as coll:
        assert coll.files == [d / SINGLE_FILE]
        assert set(coll.keys()) == set(sd)  # untied: lm_head is stored
        _check_all_equal(coll, sd)
    # A file path works as well as its directory.
    with SafetensorsCollection(d / SINGLE_FILE) as coll:
        assert set(coll.keys()) == set(sd)


def test_loose_files_without_index(sharded_copy: Path, sharded: tuple[Path, dict[str, torch.Tensor]]) -> None:
    (sharded_copy / INDEX_FILE).unlink()
    with SafetensorsCollection(sharded_copy) as coll:
        assert len(coll.files) == len(_shards(sharded_copy))
        for name in coll.keys():
            assert torch.equal(coll.get_tensor(name), sharded[1][name])


def test_prefix_queries_and_conversion(sharded: tuple[Path, dict[str, torch.Tensor]]) -> None:
    d, sd = sharded
    with SafetensorsCollection(d) as coll:
        layer1 = coll.list_prefix("model.layers.1")
        assert set(layer1) == {k for k in coll.keys() if k.startswith("model.layers.1.")}
        got = coll.get_tensors("model.layers.1", dtype=torch.bfloat16)
        assert set(got) == set(layer1)
        for k, v in got.items():
            assert v.dtype == torch.bfloat16 and torch.equal(v, sd[k].to(torch.bfloat16))
        assert coll.list_prefix("model.layers.") == [k for k in coll.keys() if k.startswith("model.layers.")]


def test_returned_tensors_outlive_close(single: tuple[Path, dict[str, torch.Tensor]]) -> None:
    d, sd = single
    coll = SafetensorsCollection(d)
    t = coll.get_tensor("model.norm.weight")
    coll.close()
    t.add_(1)  # owns writable memory, independent of the closed mapping
    assert torch.equal(t, sd["model.norm.weight"] + 1)
    with pytest.raises(LoaderError, match="closed"):
        coll.get_tensor("model.norm.weight")


# -- corruption ------------------------------------------------------------------------------------


def test_truncated_shard(sharded_copy: Path) -> None:
    shard = _shards(sharded_copy)[-1]
    raw = shard.read_bytes()
    shard.write_bytes(raw[: len(raw) - 100])
    with pytest.raises(LoaderError) as ei:
        SafetensorsCollection(sharded_copy)
    msg = str(ei.value)
    assert str(shard) in msg and "truncated" in msg and "re-download" in msg
    # The tensor whose data runs off the end is named.
    _, hdr = _header_bytes(shard)
    entries = {k: v for k, v in json.loads(hdr).items() if k != "__metadata__"}
    last = max(entries, key=lambda k: entries[k]["data_offsets"][1])
    assert repr(last) in msg


def test_header_length_beyond_file(sharded_copy: Path) -> None:
    shard = _shards(sharded_copy)[0]
    raw = bytearray(shard.read_bytes())
    raw[:8] = (len(raw) + 1).to_bytes(8, "little")
    shard.write_bytes(bytes(raw))
    with pytest.raises(LoaderError, match=re.escape(str(shard))):
        SafetensorsCollection(sharded_copy)


def _flip_positions(header: bytes) -> dict[str, int]:
    text = header.decode()
    return {
        "structure": 0,                                   # the opening '{'
        "dtype": text.index('"F32"') + 1,                 # F32 -> G32
        "offset_digit": text.index('"data_offsets":[') + len('"data_offsets":['),
        "name": text.index('"model.') + 2,                # a tensor name no longer matches the index
    }


@pytest.mark.parametrize("where", ["structure", "dtype", "offset_digit", "name"])
def test_flipped_header_byte(sharded_copy: Path, where: str) -> None:
    shard = _shards(sharded_copy)[0]
    n, header = _header_bytes(shard)
    pos = _flip_positions(header)[where]
    raw = bytearray(shard.read_bytes())
    raw[8 + pos] ^= 0x01
    shard.write_bytes(bytes(raw))
    with pytest.raises(LoaderError) as ei:
        SafetensorsCollection(sharded_copy)
    assert str(shard) in str(ei.value)
    if where == "structure":
        assert "JSON" in str(ei.value)


def test_missing_shard(sharded_copy: Path) -> None:
    victim = _shards(sharded_copy)[1]
    victim.unlink()
    with pytest.raises(LoaderError) as ei:
        SafetensorsCollection(sharded_copy)
    msg = str(ei.value)
    assert str(victim) in msg and "missing" in msg and INDEX_FILE in msg


def test_tensor_missing_from_its_shard(sharded_copy: Path) -> None:
    index = json.loads((sharded_copy / INDEX_FILE).read_text())
    wm = index["weight_map"]
    files = sorted(set(wm.values()))
    name = next(k for k, v in wm.items() if v == files[0])
    wm[name] = files[1]  # the index now promises the tensor in a shard that lacks it
    (sharded_copy / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(LoaderError) as ei:
        SafetensorsCollection(sharded_copy)
    msg = str(ei.value)
    assert repr(name) in msg and str(sharded_copy / files[1]) in msg


def _write_raw(path: Path, header: dict[str, object], data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + data)


@pytest.mark.parametrize(
    "offsets,expect",
    [
        ({"a": [0, 16], "b": [8, 24]}, "overlaps"),      # b starts inside a
        ({"a": [0, 16], "b": [20, 36]}, "unused bytes"),  # a hole
        ({"a": [16, 0], "b": [16, 32]}, "end before"),   # reversed pair
        ({"a": [0, 16], "b": [16, 28]}, "span"),         # size disagrees with shape
    ],
)
def test_bad_offsets(tmp_path: Path, offsets: dict[str, list[int]], expect: str) -> None:
    header = {k: {"dtype": "F32", "shape": [4], "data_offsets": v} for k, v in offsets.items()}
    end = max(max(v) for v in offsets.values())
    path = tmp_path / SINGLE_FILE
    _write_raw(path, header, bytes(end))
    with pytest.raises(LoaderError, match=expect) as ei:
        SafetensorsCollection(tmp_path)
    assert str(path) in str(ei.value) and ("'a'" in str(ei.value) or "'b'" in str(ei.value))


def test_trailing_garbage_and_no_weights(tmp_path: Path) -> None:
    path = tmp_path / SINGLE_FILE
    _write_raw(path, {"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}, bytes(9))
    with pytest.raises(LoaderError, match="after the last tensor"):
        SafetensorsCollection(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(LoaderError, match=re.escape(str(empty))):
        SafetensorsCollection(empty)
    with pytest.raises(LoaderError, match="does not exist"):
        SafetensorsCollection(tmp_path / "nope")


def test_expectation_mismatch_messages(sharded: tuple[Path, dict[str, torch.Tensor]]) -> None:
    d, sd = sharded
    name = "model.layers.0.self_attn.k_proj.weight"
    with SafetensorsCollection(d) as coll:
        real = list(coll.shape(name))
        wrong = [real[0] + 1, real[1]]
        with pytest.raises(LoaderError) as ei:
            coll.get_tensor(name, expect_shape=wrong)
        msg = str(ei.value)
        assert repr(name) in msg and str(coll.file_of(name)) in msg and str(wrong) in msg and str(real) in msg
        with pytest.raises(LoaderError) as ei:
            coll.get_tensor(name, expect_dtype=torch.float16)
        msg = str(ei.value)
        assert repr(name) in msg and str(coll.file_of(name)) in msg and "float16" in msg and "float32" in msg
        # Wildcards and dtype alternatives pass.
        t = coll.get_tensor(name, expect_shape=[None, real[1]], expect_dtype=(torch.float16, torch.float32))
        assert torch.equal(t, sd[name])
        with pytest.raises(LoaderError, match="similar"):
            coll.get_tensor(name.replace("k_proj", "k_prj"))


# -- all-or-nothing --------------------------------------------------------------------------------


def test_load_tensors_aliases_optional_and_int_preserved(sharded: tuple[Path, dict[str, torch.Tensor]],
                                                         tmp_path: Path) -> None:
    d, sd = sharded
    with SafetensorsCollection(d) as coll:
        reqs = {
            "q": TensorRequest("model.layers.0.self_attn.q_proj.weight", shape=(64, 64), dtype=torch.float32),
            "gone": TensorRequest("model.layers.0.self_attn.q_proj.bias", optional=True),
        }
        seen: list[tuple[int, int, str]] = []
        out = load_tensors(coll, reqs, "cpu", dtype=torch.float16,
                           progress=lambda done, total, what: seen.append((done, total, what)))
        assert set(out) == {"q"}
        assert torch.equal(out["q"], sd["model.layers.0.self_attn.q_proj.weight"].half())
        assert seen[-1][0] == seen[-1][1] == coll.nbytes("model.layers.0.self_attn.q_proj.weight")
    # Integer tensors are never converted by the dtype argument.
    ints = {"trellis": torch.randint(-(2**15), 2**15, (4, 4, 48), dtype=torch.int16), "f": torch.randn(8)}
    save_tensors(ints, tmp_path / SINGLE_FILE)
    with SafetensorsCollection(tmp_path) as coll:
        out = load_tensors(coll, ["trellis", "f"], "cpu", dtype=torch.float16)
        assert out["trellis"].dtype == torch.int16 and torch.equal(out["trellis"], ints["trellis"])
        assert torch.equal(out["f"], ints["f"].half())


def test_load_tensors_validates_before_allocating(sharded: tuple[Path, dict[str, torch.Tensor]],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    d, _ = sharded
    with SafetensorsCollection(d) as coll:
        names = coll.keys()
        calls: list[str] = []
        real_get = coll.get_tensor
        monkeypatch.setattr(coll, "get_tensor", lambda n, *a, **k: (calls.append(n), real_get(n, *a, **k))[1])
        bad = names[-1]
        reqs = [TensorRequest(n) for n in names[:-1]] + [TensorRequest(bad, shape=(1, 2, 3))]
        with pytest.raises(LoaderError) as ei:
            load_tensors(coll, reqs, "cpu")
        assert calls == []  # the bad last tensor was caught from headers: nothing was read at all
        assert repr(bad) in str(ei.value) and str(coll.file_of(bad)) in str(ei.value)
        with pytest.raises(LoaderError, match="missing"):
            load_tensors(coll, ["model.nope.weight"], "cpu")


def test_load_tensors_releases_everything_on_midway_failure(sharded: tuple[Path, dict[str, torch.Tensor]],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    d, _ = sharded
    with SafetensorsCollection(d) as coll:
        names = coll.keys()
        made: list[weakref.ref[torch.Tensor]] = []
        real_get = coll.get_tensor

        def flaky_get(name: str, *a: object, **k: object) -> torch.Tensor:
            t = real_get(name, *a, **k)
            made.append(weakref.ref(t))
            if name == names[-1]:
                half_made = t  # noqa: F841  a local pinned by the traceback unless load_tensors clears it
                raise RuntimeError("simulated device out of memory")
            return t

        monkeypatch.setattr(coll, "get_tensor", flaky_get)
        with pytest.raises(LoaderError) as ei:
            load_tensors(coll, names, "cpu")
        gc.collect()
        # Checked while the exception (and its traceback) is still alive.
        assert len(made) == len(names)
        assert all(r() is None for r in made), "a tensor from the failed load is still referenced"
        msg = str(ei.value)
        assert repr(names[-1]) in msg and str(coll.file_of(names[-1])) in msg and "simulated" in msg
        assert isinstance(ei.value.__cause__, RuntimeError)


def test_load_tensors_detects_file_changed_underneath(tmp_path: Path) -> None:
    ts = {"a": torch.randn(64), "b": torch.randn(64)}
    save_tensors(ts, tmp_path / SINGLE_FILE)
    with SafetensorsCollection(tmp_path) as coll:
        assert torch.equal(coll.get_tensor("a"), ts["a"])  # maps the file
        with open(tmp_path / SINGLE_FILE, "r+b") as f:
            f.truncate(100)  # reading b through the map now would SIGBUS
        with pytest.raises(LoaderError, match="size changed"):
            load_tensors(coll, ["b"], "cpu")


# -- writing ---------------------------------------------------------------------------------------


def _group(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:3]) if parts[1:2] == ["layers"] else name


def _raw_header(path: Path) -> dict[str, object]:
    return json.loads(_header_bytes(path)[1])


def test_save_sharded_roundtrip_and_groups(tmp_path: Path) -> None:
    sd = _tiny_model(tie=False, seed=7).state_dict()
    items = list(sd.items())
    nbytes = {k: v.numel() * v.element_size() for k, v in items}
    group_bytes: dict[str, int] = {}
    for k in sd:
        group_bytes[_group(k)] = group_bytes.get(_group(k), 0) + nbytes[k]
    limit = max(group_bytes.values()) + 1000  # every group fits, but not all in one shard
    files = save_sharded(iter(items), tmp_path, limit, group_key=_group)

    n = len(files)
    assert n > 1
    assert [f.name for f in files] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f.name for f in files] + [INDEX_FILE])
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["metadata"] == {"total_size": sum(nbytes.values())}
    wm = index["weight_map"]
    assert set(wm) == set(sd)

    # Reference reader agrees, headers carry no __metadata__, and every group sits in one file.
    shard_of_group: dict[str, set[str]] = {}
    per_file: dict[str, list[str]] = {}
    for f in files:
        assert "__metadata__" not in _raw_header(f)
        with safe_open(str(f), "pt") as r:
            assert r.metadata() is None
            for k in r.keys():
                assert wm[k] == f.name and torch.equal(r.get_tensor(k), sd[k])
                shard_of_group.setdefault(_group(k), set()).add(f.name)
                per_file.setdefault(f.name, []).append(k)
    assert all(len(v) == 1 for v in shard_of_group.values())

    # Greedy in order: files hold consecutive runs of the input, each within the limit, and the
    # first group of each next shard would not have fitted into the previous one.
    order = [k for k, _ in items]
    flat = [k for f in files for k in order if wm[k] == f.name]
    assert flat == order
    sizes = [sum(nbytes[k] for k in per_file[f.name]) for f in files]
    assert all(s <= limit for s in sizes)
    for i in range(n - 1):
        first_next = next(k for k in order if wm[k] == files[i + 1].name)
        assert sizes[i] + group_bytes[_group(first_next)] > limit

    with SafetensorsCollection(tmp_path) as coll:
        out = load_tensors(coll, list(sd), "cpu")
        assert all(torch.equal(out[k], sd[k]) for k in sd)


def test_save_sharded_single_file_replaces_stale_shards(tmp_path: Path) -> None:
    big = {f"blk.{i}.w": torch.randn(256) for i in range(4)}
    save_sharded(big.items(), tmp_path, 1500, group_key=lambda k: k.split(".")[1])
    assert (tmp_path / INDEX_FILE).exists()
    small = {"x": torch.randn(3, 5), "m": torch.tensor(-877912083, dtype=torch.int32)}
    files = save_sharded(small.items(), tmp_path, 10**9, metadata={"note": "t"})
    assert files == [tmp_path / SINGLE_FILE]
    assert sorted(p.name for p in tmp_path.iterdir()) == [SINGLE_FILE]  # stale index/shards gone
    with safe_open(str(tmp_path / SINGLE_FILE), "pt") as r:
        assert r.metadata() == {"note": "t"}
        assert all(torch.equal(r.get_tensor(k), v) for k, v in small.items())


def test_save_sharded_oversized_group_gets_own_shard(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    items = [("a.0", torch.randn(10)), ("b.0", torch.randn(100)), ("b.1", torch.randn(100)),
             ("c.0", torch.randn(10))]
    with caplog.at_level("WARNING", logger="exl3.loader"):
        files = save_sharded(items, tmp_path, 200, group_key=lambda k: k.split(".")[0])
    assert len(files) == 3 and "shard of its own" in caplog.text
    wm = json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"]
    assert wm["b.0"] == wm["b.1"] == files[1].name and wm["a.0"] == files[0].name


def test_save_tensors_atomic(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    good = {"a": torch.randn(4, 4).bfloat16(), "b": torch.randn(4).to(torch.float8_e4m3fn)}
    save_tensors(good, path)
    before = path.read_bytes()
    with pytest.raises(LoaderError, match="'c'"):
        save_tensors({"a": torch.randn(2), "c": [1, 2]}, path)  # type: ignore[dict-item]
    assert path.read_bytes() == before  # the old file survived the failed write
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]  # no temp file left
    with safe_open(str(path), "pt") as r:
        assert torch.equal(r.get_tensor("a"), good["a"])
        assert torch.equal(r.get_tensor("b").view(torch.uint8), good["b"].view(torch.uint8))


# -- progress --------------------------------------------------------------------------------------


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_tty_and_silence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EXL3_NO_PROGRESS", raising=False)
    settings.reload()
    tty = _Tty()
    with Progress(3000, "load", unit="B", stream=tty) as bar:
        bar.advance(1000)
        bar.advance(2000, what="last")
    assert "100%" in tty.getvalue() and "last" in tty.getvalue() and tty.getvalue().endswith("\n")

    pipe = io.StringIO()  # not a TTY: silent
    with Progress(10, "x", stream=pipe) as bar:
        bar.advance(10)
    assert pipe.getvalue() == ""

    monkeypatch.setenv("EXL3_NO_PROGRESS", "1")
    settings.reload()
    try:
        tty2 = _Tty()
        with Progress(10, "x", stream=tty2) as bar:
            bar.advance(10)
        assert tty2.getvalue() == ""
    finally:
        monkeypatch.delenv("EXL3_NO_PROGRESS")
        settings.reload()


def test_progress_callback_and_shared_bar(sharded: tuple[Path, dict[str, torch.Tensor]]) -> None:
    d, _ = sharded
    got: list[tuple[int, int, str]] = []
    with SafetensorsCollection(d) as coll:
        names = coll.keys()
        half = len(names) // 2
        total = coll.total_bytes()
        bar = Progress(total, "model", callback=lambda *a: got.append(a))
        load_tensors(coll, names[:half], "cpu", progress=bar)
        load_tensors(coll, names[half:], "cpu", progress=bar)
    dones = [g[0] for g in got]
    assert dones == sorted(dones) and dones[-1] == total and all(g[1] == total for g in got)
    assert [g[2] for g in got] == names

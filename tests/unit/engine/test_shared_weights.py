"""Ranks of one host map one read-only copy of the weights (engine/shared_weights.py): the
first writes it, the others map it, every rank decodes exactly what a private copy decodes,
and a file that differs in any byte, or that cannot be written, leaves the rank its own copy."""
from __future__ import annotations

import hashlib
import os

import pytest
import torch

from engine import hugepages
from engine.config import EngineConfig
from engine.layers import linear
from engine.layers.linear import Linear
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.shared_weights import PREFIX
from native import linear as kernel
from launcher.launch import make_weights_dir
from rank_runtime.core_board import remove_stale_launcher_paths


def _engine(model_dir, shared: str = "") -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), num_threads=1, kv_cache_gb=0.05,
                                  max_num_batched_tokens=256, shared_weights_dir=shared))


def _greedy(eng: LLMEngine) -> dict[str, list]:
    g = torch.Generator().manual_seed(5)
    for i, n in enumerate((9, 40, 23)):
        eng.add_request(f"r{i}", torch.randint(3, 500, (n,), generator=g).tolist(),
                        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2))
    out: dict[str, list] = {}
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend((t.token_id, t.logprob, t.top) for t in o.logprobs)
    return out


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    made = {}

    def get(family):
        if family not in made:
            eng = _engine(tiny_model_dir(family))
            made[family] = _greedy(eng)
            eng.close()
        return made[family]
    return get


@pytest.mark.parametrize("family", ["llama_tied_linear", "gemma3"])
def test_ranks_map_one_copy_and_decode_what_a_private_copy_decodes(tiny_model_dir, reference, family, tmp_path):
    first, second = _engine(tiny_model_dir(family), str(tmp_path)), _engine(tiny_model_dir(family), str(tmp_path))
    try:
        a, b = first.runner.shared_weights, second.runner.shared_weights
        assert a is not None and b is not None
        assert (a.created, b.created) == (True, False) and a.path == b.path
        # no temporary file left: the weights and the writers' lock
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([a.path.name, a.path.with_suffix(".lock").name])
        assert a.inode == b.inode
        if hugepages.enabled():  # mapped where huge pages can back it (engine/hugepages.py)
            assert a.address % hugepages.HUGE == 0 and b.address % hugepages.HUGE == 0
        for eng, sw in ((first, a), (second, b)):
            model = eng.runner.model
            assert all(sw.holds(p) for p in model.parameters())
            # with AMX a shape of whole 16-column tiles has an empty packed copy (nothing to hold)
            packed = [m._packed[1] for m in model.modules() if isinstance(m, Linear) and m._packed is not None]
            # (none without the kernel: an AVX2-only CPU)
            assert bool(packed) == linear.small_linear_available() and all(sw.holds(p) for p in packed if p.numel())
            # the AMX GEMM's copies (where the GEMM runs) are in the mapping too
            gemm = [m._gemm[1] for m in model.modules() if isinstance(m, Linear) and m._gemm is not None
                    and m._gemm[1] is not None]
            assert all(sw.holds(g) for g in gemm) and bool(gemm) == bool(kernel.amx_gemm_rows())
            if model.cfg.tie_word_embeddings:
                assert model.lm_head.weight is model.embed_tokens.weight
        assert _greedy(first) == reference(family)
        assert _greedy(second) == reference(family)
    finally:
        first.close()
        second.close()


def test_a_file_that_differs_in_one_byte_is_not_used(tiny_model_dir, reference, tmp_path):
    model_dir = tiny_model_dir("llama_tied_linear")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    writer = _engine(model_dir, str(tmp_path / "a"))
    src = writer.runner.shared_weights.path
    data = bytearray(src.read_bytes())
    writer.close()
    data[len(data) // 3] ^= 1
    (tmp_path / "b" / src.name).write_bytes(bytes(data))
    eng = _engine(model_dir, str(tmp_path / "b"))
    try:
        assert eng.runner.shared_weights is None
        assert _greedy(eng) == reference("llama_tied_linear")
    finally:
        eng.close()


def test_a_directory_that_cannot_be_written_keeps_a_private_copy(tiny_model_dir, reference, tmp_path):
    eng = _engine(tiny_model_dir("llama_tied_linear"), str(tmp_path / "missing"))
    try:
        assert eng.runner.shared_weights is None
        assert _greedy(eng) == reference("llama_tied_linear")
    finally:
        eng.close()


def test_launcher_directories_of_gone_launchers_are_removed(tmp_path, monkeypatch):
    dead = 2**22 + 12345  # above the default pid_max
    (tmp_path / f"{PREFIX}{dead}").mkdir()
    (tmp_path / f"{PREFIX}{dead}" / "x.bin").write_bytes(b"1")
    (tmp_path / f"{PREFIX}{os.getpid()}").mkdir()
    (tmp_path / f"{PREFIX}notes").mkdir()
    assert remove_stale_launcher_paths(tmp_path, PREFIX) == [tmp_path / f"{PREFIX}{dead}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"{PREFIX}{os.getpid()}", f"{PREFIX}notes"])
    d = make_weights_dir()
    try:
        assert d.name == f"{PREFIX}{os.getpid()}" and d.is_dir()
    finally:
        d.rmdir()


def test_the_launcher_gives_its_cpu_ranks_a_directory_of_its_own(tmp_path):
    from launcher.launch import LaunchConfig, rank_command, shared_weights_config

    cfg, d = shared_weights_config(EngineConfig(), LaunchConfig(colocated=2))
    try:
        assert d is not None and cfg.shared_weights_dir == str(d) and d.is_dir()
        cmd = rank_command(cfg, LaunchConfig(colocated=2), "colocated", 1, "ipc://x")
        assert cmd[cmd.index("--shared-weights-dir") + 1] == str(d)
    finally:
        d.rmdir()
    # one rank, CUDA, stand-in ranks: nothing to share
    for eng, launch in ((EngineConfig(), LaunchConfig(colocated=1)),
                        (EngineConfig(device="cuda"), LaunchConfig(prefill=1, decode=1)),
                        (EngineConfig(), LaunchConfig(colocated=2, fake_ranks=True))):
        assert shared_weights_config(eng, launch) == (eng, None)
    # a directory given is used as it is (and not the launcher's to remove); --no-share-weights: none
    given = EngineConfig(shared_weights_dir=str(tmp_path))
    assert shared_weights_config(given, LaunchConfig(colocated=2)) == (given, None)
    cfg, d = shared_weights_config(given, LaunchConfig(colocated=2, share_weights=False))
    assert d is None and cfg.shared_weights_dir == ""
    assert "--shared-weights-dir" not in rank_command(cfg, LaunchConfig(colocated=2), "colocated", 0, "ipc://x")


def test_ranks_that_start_together_write_one_file_and_all_map_it(tmp_path):
    import threading

    from engine.layers.linear import Linear
    from engine.shared_weights import share_weights

    def model():
        torch.manual_seed(0)
        m = torch.nn.Sequential(*(Linear(256, 512, bias=False) for _ in range(8))).to(torch.bfloat16)
        for lin in m:
            lin.prepare()
        return m

    models = [model() for _ in range(4)]
    want = [lin.weight.clone() for lin in models[0]]
    start, got = threading.Barrier(len(models)), [None] * len(models)

    def rank(i):
        start.wait()
        got[i] = share_weights(models[i], tmp_path, "toy|bfloat16")

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(models))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(g is not None for g in got)
    assert sum(g.created for g in got) == 1 and len({g.inode for g in got}) == 1
    for m, g in zip(models, got):
        assert all(g.holds(lin.weight) for lin in m)
        assert all(torch.equal(lin.weight, w) for lin, w in zip(m, want))


def test_a_file_of_another_size_is_not_used(tiny_model_dir, reference, tmp_path):
    model_dir = tiny_model_dir("llama_tied_linear")
    (tmp_path / "a").mkdir()
    writer = _engine(model_dir, str(tmp_path / "a"))
    name = writer.runner.shared_weights.path.name
    writer.close()
    (tmp_path / name).write_bytes(b"short")  # same name, a few bytes
    eng = _engine(model_dir, str(tmp_path))
    try:
        assert eng.runner.shared_weights is None
        assert _greedy(eng) == reference("llama_tied_linear")
    finally:
        eng.close()


def _as_q4_1(src, out):
    """A copy of checkpoint `src` whose 2-D weights are GGUF Q4_1 dequantized values (d q + m per
    32-weight block, d and m fp16): what the cache holds for a GGUF model."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    for f in out.glob("*.safetensors"):
        sd = load_file(str(f))
        for name, t in sd.items():
            if t.dim() == 2 and t.shape[1] % 32 == 0:
                b = t.reshape(t.shape[0], -1, 32)
                lo = b.amin(-1, keepdim=True).half().float()
                d = ((b.amax(-1, keepdim=True) - lo) / 15).half().float()
                q = torch.where(d > 0, (b - lo) / d, 0).round().clamp(0, 15)  # (a padding row: all 0)
                sd[name] = (d * q + lo).reshape(t.shape).contiguous()
        save_file(sd, str(f), metadata={"format": "pt"})
    return out


@pytest.mark.skipif(not linear.small_linear_available(), reason="no AVX512-BF16 kernel on this CPU: no quant copies")
def test_quant_copies_are_shared_and_decode_the_bits_of_the_bf16_weights(tiny_model_dir, tmp_path, monkeypatch):
    model_dir = _as_q4_1(tiny_model_dir("llama_tied_linear"), tmp_path / "q4")
    shared = tmp_path / "shared"
    shared.mkdir()
    first, second = _engine(model_dir, str(shared)), _engine(model_dir, str(shared))
    monkeypatch.setattr(linear, "pack_quant_weight", lambda *a, **k: None)  # this one reads the bf16 weights
    private = _engine(model_dir)
    try:
        for eng in (first, second):
            sw, model = eng.runner.shared_weights, eng.runner.model
            quant = [m.quant_weight() for m in model.modules() if isinstance(m, Linear)]
            assert sw is not None and quant and all(q is not None and sw.holds(q) for q in quant)
        assert not any(m.quant_weight() is not None for m in private.runner.model.modules() if isinstance(m, Linear))
        expect = _greedy(private)
        assert _greedy(first) == expect and _greedy(second) == expect
    finally:
        first.close()
        second.close()
        private.close()


def _toy(seed: int, device: str = "cpu"):
    """Linear layers with kernel copies of every kind (made up: their bytes are what matters
    here, not the kernel's layout) and one weight tied between two layers."""
    with torch.device(device):
        m = torch.nn.Sequential(*(Linear(64, 128, bias=False) for _ in range(4))).to(torch.bfloat16)
    if device == "meta":
        return m
    g = torch.Generator().manual_seed(seed)
    for lin in m:
        lin.weight = torch.nn.Parameter(torch.randn(128, 64, generator=g).bfloat16(), requires_grad=False)
    m[3].weight = m[0].weight  # tied
    m[0]._packed = (m[0].packed_key(), torch.randn(3, 5, generator=g).bfloat16())
    m[1]._gemm = (m[1].gemm_key(), None)  # the GEMM does not run this shape
    m[2]._gemm = (m[2].gemm_key(), torch.randint(0, 255, (77,), generator=g, dtype=torch.uint8))
    m[2]._quant = (Linear.packed_key(m[2]), torch.randint(0, 255, (300,), generator=g, dtype=torch.uint8))
    return m


def test_a_rank_that_finds_the_file_maps_its_weights_and_kernel_copies_without_loading(tmp_path):
    from engine.shared_weights import share_weights

    writer = _toy(0)
    want = {n: t.clone() for n, t in writer.state_dict().items()}
    copies = {(i, a): getattr(writer[i], a)[1] for i, a in ((0, "_packed"), (2, "_gemm"), (2, "_quant"))}
    copies = {k: v.clone() for k, v in copies.items()}
    a = share_weights(writer, tmp_path, "toy|bfloat16")
    reader = _toy(0, "meta")

    def load():
        raise AssertionError("a rank that finds the file must not load")

    b = share_weights(reader, tmp_path, "toy|bfloat16", load)
    assert a is not None and b is not None and (a.created, b.created) == (True, False)
    for m, sw in ((writer, a), (reader, b)):
        assert all(sw.holds(p) for p in m.parameters()) and not any(p.is_meta for p in m.parameters())
        assert m.state_dict().keys() == want.keys()
        assert all(torch.equal(t, want[n]) for n, t in m.state_dict().items())
        assert m[3].weight is m[0].weight  # still one tensor
        assert m[0]._packed[0] == m[0].packed_key() and torch.equal(m[0].packed_weight(), copies[0, "_packed"])
        assert m[1]._gemm == (m[1].gemm_key(), None)
        assert m[2]._gemm[0] == m[2].gemm_key() and torch.equal(m[2]._gemm[1], copies[2, "_gemm"])
        assert torch.equal(m[2].quant_weight(), copies[2, "_quant"]) and m[0].quant_weight() is None
        assert all(sw.holds(t) for t in (m[0]._packed[1], m[2]._gemm[1], m[2]._quant[1]))


def test_ranks_that_start_together_load_once_and_all_map_it(tmp_path):
    import threading

    from engine.shared_weights import share_weights

    models, loads = [_toy(0, "meta") for _ in range(4)], []
    start, got = threading.Barrier(len(models)), [None] * len(models)

    def rank(i):
        def load():
            loads.append(i)
            loaded = _toy(0)
            for dst, src in zip(models[i], loaded):
                dst.__dict__.update({k: v for k, v in src.__dict__.items() if k in ("_packed", "_gemm", "_quant")})
                dst._parameters = src._parameters
        start.wait()
        got[i] = share_weights(models[i], tmp_path, "toy|bfloat16", load)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(models))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(loads) == 1 and all(g is not None for g in got) and len({g.inode for g in got}) == 1
    want = _toy(0).state_dict()
    for m in models:
        assert all(torch.equal(t, want[n]) for n, t in m.state_dict().items())


def test_a_file_of_another_identity_or_layout_is_not_used(tmp_path):
    from engine.shared_weights import share_weights

    assert share_weights(_toy(0), tmp_path, "toy|bfloat16") is not None
    src = next(tmp_path.glob("*.bin"))
    other = tmp_path / "other"
    other.mkdir()
    # the same file under the name of another identity (a hash collision, say): its header says whose it is
    key = hashlib.blake2b(b"toy|float32", digest_size=12).hexdigest()
    (other / f"{PREFIX}{key}.bin").write_bytes(src.read_bytes())
    loads = []
    m = _toy(0, "meta")
    assert share_weights(m, other, "toy|float32", lambda: loads.append(1)) is None and loads == [1]
    # a model of another layout finds the file of its identity but does not take it
    wide = torch.nn.Sequential(*(Linear(64, 256, bias=False) for _ in range(4))).to(torch.bfloat16)
    assert share_weights(wide, tmp_path, "toy|bfloat16") is None


def test_the_identity_covers_the_checkpoint_bytes_and_the_kernel_settings(tmp_path, monkeypatch):
    from engine.shared_weights import weights_identity

    (tmp_path / "model.safetensors").write_bytes(b"\0" * 100)
    (tmp_path / "config.json").write_text("{}")
    base = weights_identity(tmp_path, "bfloat16")
    assert weights_identity(tmp_path, "bfloat16") == base and weights_identity(tmp_path, "float32") != base
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 99 + b"\1")
    changed = weights_identity(tmp_path, "bfloat16")
    assert changed != base
    monkeypatch.setenv("PDSERVE_KERNELS", "torch")  # no packed copies
    assert weights_identity(tmp_path, "bfloat16") != changed


def test_an_engine_that_finds_the_file_does_not_read_the_checkpoint(tiny_model_dir, reference, tmp_path, monkeypatch):
    from engine.models.weights import WeightLoader

    model_dir = tiny_model_dir("llama_tied_linear")
    want = reference("llama_tied_linear")
    first = _engine(model_dir, str(tmp_path))

    def refuse(*_):
        raise AssertionError("the checkpoint was read")

    monkeypatch.setattr(WeightLoader, "load_into", refuse)
    second = _engine(model_dir, str(tmp_path))
    try:
        assert second.runner.shared_weights is not None and not second.runner.shared_weights.created
        assert "weights" not in second.runner.load_phases
        assert _greedy(second) == want
    finally:
        first.close()
        second.close()


def test_checkpoint_digests_are_kept_by_path_and_stat(tmp_path, monkeypatch):
    """weights_identity hashes each checkpoint file once per content: later ranks read its SHA-1
    from $PDSERVE_CACHE_DIR/digests/ while the file's stat is the same; a rewritten file is hashed
    again, and one written less than DIGEST_SETTLE_S ago is not kept (its mtime could repeat)."""
    from engine import shared_weights

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"\0" * 100)
    assert shared_weights._file_sha1(f) == hashlib.sha1(b"\0" * 100).hexdigest()
    assert not (tmp_path / "cache" / "digests").exists()  # just written: not kept
    old = int((os.path.getmtime(f) - 60) * 1e9)
    os.utime(f, ns=(old, old))
    assert shared_weights._file_sha1(f) == hashlib.sha1(b"\0" * 100).hexdigest()
    assert len(list((tmp_path / "cache" / "digests").iterdir())) == 1

    real = hashlib.file_digest
    monkeypatch.setattr(hashlib, "file_digest", lambda *a: pytest.fail("hashed a file whose digest is kept"))
    assert shared_weights._file_sha1(f) == hashlib.sha1(b"\0" * 100).hexdigest()
    monkeypatch.setattr(hashlib, "file_digest", real)
    f.write_bytes(b"\0" * 99 + b"\1")  # same size; the mtime moves on
    os.utime(f, ns=(old + 1, old + 1))
    assert shared_weights._file_sha1(f) == hashlib.sha1(b"\0" * 99 + b"\1").hexdigest()

"""Ranks of one host map one read-only copy of the weights (engine/shared_weights.py): the
first writes it, the others map it, every rank decodes exactly what a private copy decodes,
and a file that differs in any byte, or that cannot be written, leaves the rank its own copy."""
from __future__ import annotations

import os

import pytest
import torch

from engine import hugepages
from engine.config import EngineConfig
from engine.layers import linear
from engine.layers.linear import Linear
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from decode.core_board import remove_stale_launcher_paths
from engine.shared_weights import PREFIX
from pd_server.launch import make_weights_dir


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
            assert packed and all(sw.holds(p) for p in packed if p.numel())
            # the AMX GEMM's copies (where the GEMM runs) are in the mapping too
            gemm = [m._gemm[1] for m in model.modules() if isinstance(m, Linear) and m._gemm is not None
                    and m._gemm[1] is not None]
            assert all(sw.holds(g) for g in gemm) and bool(gemm) == bool(linear.amx_gemm_rows())
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
    from pd_server.launch import LaunchConfig, rank_command, shared_weights_config

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
    monkeypatch.setenv("PDSERVE_QUANT_COPY", "0")
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

"""Model/engine configuration: clear errors for what the runner cannot honour."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from engine.config import EngineConfig, ModelConfig, add_cli_args, from_cli_args
from engine.model_cache import cached_model_dir

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def test_unsupported_architecture_is_named():
    with pytest.raises(ValueError, match="FalconForCausalLM"):
        ModelConfig.from_hf_dict({**BASE, "architectures": ["FalconForCausalLM"]})


def test_unhonourable_config_is_named():
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        ModelConfig.from_hf_dict({**BASE, "final_logit_softcapping": 30.0})
    with pytest.raises(ValueError, match="rope scaling type 'yarn'"):
        ModelConfig.from_hf_dict({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="activation"):
        ModelConfig.from_hf_dict({**BASE, "hidden_act": "relu"})


def test_rope_forms_of_both_transformers_generations():
    old = ModelConfig.from_hf_dict({**BASE, "rope_theta": 5e5, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}})
    new = ModelConfig.from_hf_dict({**BASE, "rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192, "rope_theta": 5e5}})
    assert old.rope == new.rope and old.rope["full_attention"].theta == 5e5


def test_qwen2_always_has_qkv_bias_and_gemma_layer_pattern():
    q = ModelConfig.from_hf_dict({**BASE, "architectures": ["Qwen2ForCausalLM"], "attention_bias": None})
    assert q.qkv_bias
    g = ModelConfig.from_hf_dict({**BASE, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 12,
                                  "sliding_window": 512, "query_pre_attn_scalar": 256})
    assert g.full_layers == (5, 11) and len(g.swa_layers) == 10


def test_missing_model_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither"):
        cached_model_dir(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        cached_model_dir(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        cached_model_dir(str(tmp_path))


def test_engine_config_validation_and_cli_roundtrip():
    with pytest.raises(ValueError, match="page_size"):
        EngineConfig(page_size=12)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="int8")
    assert EngineConfig(dtype="fp32").dtype == "float32"
    ap = argparse.ArgumentParser()
    add_cli_args(ap, EngineConfig)
    cfg = from_cli_args(ap.parse_args(["--page-size", "32", "--max-num-seqs", "7", "--hicache-scope", "host"]),
                        EngineConfig)
    assert cfg.page_size == 32 and cfg.max_num_seqs == 7 and cfg.hicache_scope == "host"
    with pytest.raises(SystemExit):  # a choice outside the field's Literal
        ap.parse_args(["--hicache-scope", "cluster"])
    assert [f.name for f in dataclasses.fields(EngineConfig) if not f.metadata.get("help")] == []  # every flag: help


def test_dtype_auto_is_bf16_only_where_it_runs_natively(monkeypatch):
    from engine import config

    for native, cpu in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(config, "cpu_has_bf16", lambda native=native: native)
        assert EngineConfig().dtype == EngineConfig(dtype="auto").dtype == cpu
        assert EngineConfig(dtype="auto", device="cuda").dtype == "bfloat16"
        assert EngineConfig(dtype="bf16").dtype == "bfloat16" and EngineConfig(dtype="fp32").dtype == "float32"
    with pytest.raises(ValueError, match="auto or one of"):
        EngineConfig(dtype="int8")


def test_the_launchers_pools_hold_as_many_tokens_in_float32():
    from launcher.launch import _pools_for_dtype
    from rank_runtime.config import HandoffConfig

    hand = HandoffConfig(handoff_pool_gb=0.25)
    e, h = _pools_for_dtype(EngineConfig(dtype="float32", hicache_size_gb=0.25), hand, [], 2)
    assert (e.hicache_size_gb, h.handoff_pool_gb) == (0.5, 0.5)
    e, h = _pools_for_dtype(EngineConfig(dtype="float32", hicache_size_gb=0.25), hand,
                            ["--hicache-size-gb=0.25", "--handoff-pool-gb", "0.25"], 2)
    assert (e.hicache_size_gb, h.handoff_pool_gb) == (0.25, 0.25)  # given: kept
    e, h = _pools_for_dtype(EngineConfig(dtype="bfloat16", hicache_size_gb=0.25), hand, [], 2)
    assert (e.hicache_size_gb, h.handoff_pool_gb) == (0.25, 0.25)


def test_ray_mode_configs_and_the_missing_ray_message(monkeypatch):
    """--ray: the rank socket leaves loopback for this node's IP, each rank binds its own node's
    IP (a placeholder its actor fills in), and nothing that assumes one host stays on; without
    Ray installed the launcher says how to install it."""
    import subprocess
    import sys

    from launcher import launch as L, ray_ranks
    from pd_server.config import RouterConfig

    with pytest.raises(ValueError, match="spread or pack"):
        L.LaunchConfig(ray="auto", ray_placement="round")
    monkeypatch.setattr(ray_ranks, "connect", lambda address: "10.1.2.3")
    cfg, launch, eng, node_ip = ray_ranks.configs_for_ray(RouterConfig(), L.LaunchConfig(ray="auto", prefill=1,
                                                                                         decode=1),
                                                          EngineConfig(num_threads=2))
    assert cfg.rank_addr == "tcp://10.1.2.3:*" and eng.num_threads == 2 and node_ip == "10.1.2.3"
    assert (launch.prefill_host, launch.decode_host) == (ray_ranks.NODE_IP, ray_ranks.NODE_IP)
    assert not (launch.lend_cores or launch.pin_cores or launch.share_weights)
    cmd = L.rank_command(eng, launch, "decode", 0, cfg.rank_addr, core_board="", cpus=[0, 1])
    assert cmd[cmd.index("--host") + 1] == ray_ranks.NODE_IP and "--cpus" not in cmd
    try:
        import ray  # noqa: F401
    except ImportError:
        out = subprocess.run([sys.executable, "-m", "launcher.launch", "--ray", "auto", "--colocated", "1"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and "scripts/setup_ray.sh" in out.stderr

"""vLLM's KV geometry from its ``vllm:`` series (issue 21 item 8; uapplace.measure.geometry)."""

from __future__ import annotations

from uapplace.core.model import Config, ConfigStatus
from uapplace.io.engines import parse_prometheus
from uapplace.measure.geometry import kv_geometry, launch_flags

VLLM_METRICS = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="fp8",enable_prefix_caching="True",\
gpu_memory_utilization="0.9",num_cpu_blocks="2048",num_gpu_blocks="4096"} 1.0
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="qwen"} 0.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="qwen"} 0.0
"""

EXEC_START = (
    "/opt/vllm/bin/vllm serve Qwen/Qwen2.5-7B --port 8000 --max-model-len 16384 "
    "--gpu-memory-utilization 0.9"
)


def test_vllm_cache_config_info_gives_the_pool_the_dtype_and_a_fixed_rate() -> None:
    config = Config("c1", ConfigStatus.UNMEASURED)
    geometry = kv_geometry(
        config, parse_prometheus(VLLM_METRICS), None, None, launch_flags(EXEC_START)
    )
    assert geometry.fields == {
        "context_pool_cells": 4096 * 16,
        "kv_resident_cells": 4096 * 16,
        "kv_mib_per_1k_cells": 0.0,
        "kv": "fp8",
        "per_session_cap_cells": 16384,
    }
    assert "num_gpu_blocks 4096 × block_size 16" in geometry.sources["context_pool_cells"]
    assert geometry.sources["per_session_cap_cells"] == "ExecStart --max-model-len"


def test_without_the_cache_info_nothing_is_invented() -> None:
    text = "\n".join(VLLM_METRICS.splitlines()[4:]) + "\n"
    config = Config("c1", ConfigStatus.UNMEASURED)
    geometry = kv_geometry(config, parse_prometheus(text), None, None, launch_flags(EXEC_START))
    assert "context_pool_cells" not in geometry.fields
    assert "kv" not in geometry.fields

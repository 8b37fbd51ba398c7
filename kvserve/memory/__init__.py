"""The KV memory planner: how much KV a model needs, how many requests fit, and what bounds each phase."""
from kvserve.memory.planner import DEVICES, Device, capacity, kv_bytes, kv_bytes_per_token, kv_layout, mha_factor, roofline
from kvserve.memory.report import PlanRequest, plan
from kvserve.memory.spec import PRESETS, ModelSpec, load_spec, spec_from_hf_config

__all__ = ["DEVICES", "Device", "ModelSpec", "PRESETS", "PlanRequest", "capacity", "kv_bytes", "kv_bytes_per_token",
           "kv_layout", "load_spec", "mha_factor", "plan", "roofline", "spec_from_hf_config"]

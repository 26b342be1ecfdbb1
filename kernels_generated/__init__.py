"""Modules emitted by `moe-tune emit`: each imports only torch and triton and exposes `fused_experts`."""

"""moe-tune: a code-generating Triton autotuner for the MoE routed-experts operation.

Data flows one way:

    Case -> Variant (space) -> module source (render) -> compile, verify, time (runner)
         -> trial rows (db) -> best Variant per case -> kernels_generated/<name>.py (emit)
"""

__version__ = "0.1.0"

"""flint-aot: ahead-of-time builder of Flint's fused decode qkv kernels (CuTe DSL -> cubin bundle)."""

__version__ = "0.1.0"

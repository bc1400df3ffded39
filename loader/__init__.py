"""flint-aot serve-time loader: loads the bundle's cubins and launches them from torch.

Needs only torch and cuda-bindings; never imports the DSL or the build-time package. The ops are
imported lazily, so `import loader` alone (as the builder does for the manifest schema) stays light.
"""

from loader.manifest import SCHEMA_VERSION, Manifest, ManifestError  # noqa: F401

_OPS = {
    "load_bundle",
    "current_bundle",
    "rms_norm",
    "fused_add_rms_norm",
    "flint_qkv_fused",
    "gemv",
    "qk_norm_rope_cache",
    "no_rope_table",
    "BundleError",
    "set_pdl",
    "set_bounds_check",
}


def __getattr__(name):
    if name in _OPS:
        from loader import ops

        return getattr(ops, name)
    raise AttributeError(f"module 'loader' has no attribute {name!r}")

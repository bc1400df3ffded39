"""What a diagnostic build asks of the built-in kernels: the config's `diagnostics` section (docs/config.md),
handed to each kernel class by the compile process. Never for serving: a bundle built with any of it is a
diagnostic bundle (its manifest's config says so, and the loader warns when it loads one). A build without
the section gets the defaults, and its cubins are those of kernels that have no diagnostics at all."""

from __future__ import annotations

from dataclasses import dataclass

CLUSTER_POLICIES = ("default", "spread", "load_balancing")  # ("default": the driver's)


@dataclass(frozen=True)
class Diagnostics:
    timeline: bool = False  # compile the named trace points in (kernels/trace.py; tools/timeline.py)
    norm_spin_cycles: int = 0  # the norm kernel busy-waits this long before its stores: a slow producer
    cluster_policy: str = ""  # every cluster kernel launched with this scheduling policy (A/B runs)

    @classmethod
    def from_config(cls, section: dict | None) -> Diagnostics:
        return cls(**(section or {}))

    def __bool__(self) -> bool:
        return self != Diagnostics()


SERVING = Diagnostics()  # a serving build's: nothing asked

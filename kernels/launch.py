"""Launch configurations of the Triton kernels: tiles, warps and stages, chosen per GPU generation.

Each Triton module keeps a table from (kernel, dtype class, generation) to a :class:`LaunchConfig` and
passes ``config.kwargs()`` to every launch, so the tiles, ``num_warps``, ``num_stages`` and the
floating-point fusion setting a GPU compiles come from one place. ``tools/compile_kernels.py`` compiles
each entry for sm_80 and sm_90a and fails on a register spill; docs/decisions.md ("Launch
configurations") says why each entry is what it is.
"""

from __future__ import annotations

from dataclasses import dataclass

# Fused multiply-add on, said explicitly: Triton 3.9 fuses by default and warns that 3.10 will not, which
# would change every kernel's rounding under an upgrade. The interpreter ignores the option.
FP_FUSION = True


@dataclass(frozen=True)
class LaunchConfig:
    """One launch's tile sizes (constexpr name -> size), warps and software-pipelining stages."""

    blocks: tuple[tuple[str, int], ...]
    num_warps: int = 4
    num_stages: int = 3

    @classmethod
    def of(cls, num_warps: int = 4, num_stages: int = 3, **blocks: int) -> LaunchConfig:
        return cls(tuple(blocks.items()), num_warps, num_stages)

    def __getitem__(self, name: str) -> int:
        return dict(self.blocks)[name]

    def kwargs(self) -> dict[str, int | bool]:
        """The keyword arguments of ``kernel[grid](...)``: the tiles and the compiler options."""
        return {**dict(self.blocks), "num_warps": self.num_warps, "num_stages": self.num_stages,
                "enable_fp_fusion": FP_FUSION}

"""torchtitan integration of GIFT (guide: docs/torchtitan.md).

``--module gift_compile.torchtitan_ext --config <fn>`` makes torchtitan's ConfigManager
import :mod:`gift_compile.torchtitan_ext.config_registry`; ``gift-train`` runs it from a
TOML file. This package module itself imports nothing, so that importing it never pulls
in torchtitan (whose import needs :mod:`.cpu_compat` first on machines without Triton).
"""

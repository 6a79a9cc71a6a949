"""torchtitan integration of GIFT (guide: docs/torchtitan.md).

This package is what a torchtitan user imports or configures: the ``[gift]`` section
(`section`, `keys`), the trainer configs (`job_config`), the hooks and pass pipeline that apply
GIFT (`hooks`, `hsdp`, `pipeline`, `pipeline_parallel`), checkpoints, telemetry, the
``gift-train`` launcher and its entry point (`launcher`, `train`), and `platform_hooks`, where a
platform adapter registers its adjustments. The subpackage `cpu` holds the CPU stand-ins that
let torchtitan run on a CPU-only box (`cpu_compat`, the embedded corpus and its data loader,
the debug models and config registry, the demo) and the test drivers (`runs`, `kill_resume`);
they import the integration, never the reverse (only the two entry points import
`cpu.cpu_compat`, inside their `main`). ``--module gift_compile.torchtitan_ext.cpu --config
<fn>`` makes torchtitan's ConfigManager import :mod:`gift_compile.torchtitan_ext.cpu.config_registry`;
``gift-train`` runs it from a TOML file. This package module itself imports nothing, so that
importing it never pulls in torchtitan (whose import needs `cpu.cpu_compat` first on machines
without Triton).
"""

"""The CPU stand-ins and test drivers of the torchtitan integration.

What lets torchtitan 0.3.0 run GIFT on a CPU-only box with gloo (`cpu_compat`, which registers
its adjustments with the integration's `platform_hooks`), the embedded Shakespeare corpus, its
tokenizer and data loader (`corpus`, `data`, `language_modeling`), the debug model specs and
the config registry that ``--module gift_compile.torchtitan_ext.cpu`` names (`models`,
`config_registry`), ``make demo`` (`demo`), and the drivers that launch and kill runs for the
tests and the bench (`runs`, `kill_resume`). These modules may import the integration
(`gift_compile.torchtitan_ext`); the integration never imports them, apart from the two entry
points' launcher-side `cpu_compat.activate()`.
"""

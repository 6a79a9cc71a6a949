"""Multi-rank and topology experiments on gloo ranks and torchtitan launches: bytes per hop
(`hop_bytes`), every torchtitan layout (`layouts`, its rows in `layout_table`), the cost of the
cross-rank checks, soak, exit stress, the fault table, the config walk, selection churn (and
the emulated multi-node cluster). They import `bench.lib`, `bench.fidelity` and
`gift_compile.torchtitan_ext` (its integration and stand-ins), and write `bench/results/cluster/`."""

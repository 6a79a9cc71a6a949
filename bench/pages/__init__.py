"""Page generators: the README and docs blocks (`readme`, `blocks`, `frontier`, `layouts`,
`selection`), REPORT.md (`report`, `report_convergence`, `report_cost`) and the figures
(`plots`). They only read committed results; they may import any room below them for its
names (commands, file paths, arm tables), and no experiment imports them."""

"""Step-time models: the CPU-bytes projection of Llama-600M (`cpu`) and the step model of a
cluster laid out as nodes (`topology`: every arm by the same rules, its inputs in
`bench/results/step_model/step_model_inputs.json`, `--validate` against an emulated-cluster
run), with the codec priced from the H200 measurement (`pricing`). They compute from measured
inputs and run nothing distributed; they import `bench.lib` and `bench.fidelity` (the codec's
traffic) and write `bench/results/step_model/`."""

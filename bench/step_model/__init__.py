"""Step-time models: the CPU-bytes projection of Llama-600M (`cpu`), the Llama-3-8B step priced
from the H200 measurement (`gpu`, with the prices in `pricing`), the network laid out as nodes
(`topology`) and flat FSDP against HSDP (`hsdp`). They compute from measured inputs and run
nothing distributed; they import `bench.lib` and `bench.fidelity` (the codec's traffic) and
write `bench/results/step_model/`."""

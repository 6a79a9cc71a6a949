"""The bench's shared library: the study model (`tiny_llama`), the reference model and its real
gradients with the reference optimizers (`reference`), the profiles' sizes (`settings`), the
statistics (`stats`), number formatting for every generated page (`formatting`), provenance,
the model configurations the wire and step models price (`wire`) and the results folder
(`paths`). It measures nothing on its own behalf and imports no other bench room (only
`gift_compile` and the torchtitan stand-ins' corpus); every other room may import it."""

"""The forward path's parts: attention over the paged KV cache (attention), rotary embeddings (rope), GGUF's
quantized weights (quant), sampling (sampler) and its grammar masks (guided), and the optional compiled CPU kernels
they dispatch to (kernels, built from csrc/ per ISA level). A model (services/engine/models/) is made of these; the
scheduler, the KV manager and the engine around them live one level up."""

"""The model architectures the engine runs, built from services/engine/layers/: llama.py (Llama and Qwen2: RMSNorm,
rotary attention with grouped KV heads, SwiGLU; tied or untied embeddings, QKV biases)."""

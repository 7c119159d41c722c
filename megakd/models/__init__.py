"""Model definitions: `encoder` (config, layers, Encoder), `heads`, `electra` (task models and the
generator/discriminator pair), `admin` (Admin init) and `hf_mapping` (exact HF state-dict mapping,
the only module here that imports transformers)."""

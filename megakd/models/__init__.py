"""Model definitions: `encoder` (config, layers, Encoder), `heads`, `electra` (task models and the
generator/discriminator pair), `admin` (Admin init), `hf_mapping` (exact HF state-dict mapping,
the only module here that imports transformers) and `logreg` (the logistic-regression estimator
the probe and the tf-idf baseline fit)."""

"""Persistence: everything megakd writes to disk and reads back, below the engine.

- `checkpoint`: checkpoint layout, atomic commit with a sha256 manifest, verification, fallback.
- `checkpoint_models`: the trained models inside a checkpoint, whichever backend wrote it.
- `model_dir`: megakd model directories, fine-tuned classifier directories, HF directories read in.
- `load`: `load_model(src)`, the one entry point for reading a trained model; tokenizer checks; freezing.
- `rundir`: run-directory ownership (refuse reuse, move aside, lock) and the config history.
- `admin_profile`: run.dir/admin_profile.json, Admin's ω from a run's first start (checksummed, checked against the
  run's models and seed).
- `files`: safetensors / weights-only formats, fsync, sha256.
"""

from megakd.store.files import StoreError
from megakd.store.load import StoredModels, check_same_tokenizer, check_source, freeze, load_model

__all__ = ["StoreError", "StoredModels", "check_same_tokenizer", "check_source", "freeze", "load_model"]

"""HuggingFace conversion (`megakd convert to-hf | from-hf`).

- `to_hf(src, out)`: a run / checkpoint (single, ddp or DeepSpeed ZeRO 0-3) / model directory →
  HF directories with config, safetensors weights and a tokenizer `AutoTokenizer` loads offline.
- `export_run(run_dir)`: the end-of-run export to `run_dir/hf` that `megakd pretrain` calls.
- `from_hf(src, out)`: a local HF BERT/ELECTRA directory → a megakd model directory.

Reading models (any source) and model directories live in `megakd.store`.
"""

from megakd.convert.common import ConversionError
from megakd.convert.export import export_run, save_hf_model, to_hf
from megakd.convert.hf_import import from_hf
from megakd.store.model_dir import load_model_dir, read_model_dir_info, save_model_dir

__all__ = ["ConversionError", "export_run", "from_hf", "load_model_dir", "read_model_dir_info", "save_hf_model",
           "save_model_dir", "to_hf"]

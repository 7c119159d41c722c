"""Downstream fine-tuning (`megakd finetune`): classification/regression, multi-seed mean ± std,
label regularisation, and the fine-tuning-time methods built on it: SoTeacher (`soteacher.py`)
and TGT (`tgt.py`)."""

"""Downstream fine-tuning (`megakd finetune`): GLUE-style classification/regression with the
dissertation's setup, multi-seed mean ± std, and label regularisation. SoTeacher and TGT build on
it in `megakd.distill`."""

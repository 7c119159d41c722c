"""The findings `megakd repro` knows, and the module that declares each (megakd/repro/<module>.py)."""

# name -> module; `megakd repro all` declares them in this order (soteacher's shared encoder is the
# one tgt fine-tunes too: one job).
MODULES = {"lambda": "lambda_finding", "disc_lr": "disc_lr", "dwt": "dwt", "soteacher": "soteacher",
           "labelreg": "labelreg", "tgt": "tgt", "gen_size": "gen_size",
           "electra_vs_mlm": "electra_vs_mlm"}
FINDINGS = tuple(MODULES)
# The findings whose recipe is an ELECTRA pretraining recipe (configs/electra-mini.yaml by default);
# `all --recipe R` passes R to these (lambda keeps electra-tiny, dwt its BERT-MLM student recipe,
# labelreg the masked LM bert-mini-long).
ELECTRA_RECIPE_FINDINGS = ("disc_lr", "soteacher", "tgt", "gen_size")

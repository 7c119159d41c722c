"""`megakd glue`: GLUE from its own files, its official metrics, ELECTRA's protocol and the test-set submission,
as a layer over `megakd finetune` (docs/glue.md)."""

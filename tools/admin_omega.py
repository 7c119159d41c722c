"""Print the Admin ω range of a BERT-base-sized encoder (12 × 768) under both `model.*.admin_profile`s.

One profiling batch of 8 × 128 uniformly random token ids (vocabulary 8000), seed 0, dropout 0.1:

    python tools/admin_omega.py
"""

from __future__ import annotations

import torch

from megakd.models.admin import admin_initialize
from megakd.models.encoder import ADMIN_PROFILES, Encoder, EncoderConfig


def main() -> None:
    ids = torch.randint(5, 8000, (8, 128), generator=torch.Generator().manual_seed(0))
    print("| admin_profile | first ω | last ω |\n|---|---|---|")
    for profile in ADMIN_PROFILES:
        torch.manual_seed(0)
        encoder = Encoder(EncoderConfig(vocab_size=8000, hidden_size=768, num_layers=12, num_heads=12,
                                        intermediate_size=3072, max_position_embeddings=128, init="admin",
                                        admin_profile=profile))
        omegas = admin_initialize(encoder, ids, torch.ones_like(ids), seed=0)
        print(f"| {profile} | {omegas[0]:.3f} | {omegas[-1]:.3f} |")


if __name__ == "__main__":
    main()

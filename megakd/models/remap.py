"""Parameter remapping: initialise a student MaskedLM from a (shallower, narrower) teacher MaskedLM.

DWT's "parameter remapping" (docs/methods.md § DWT, FNA-style): student layer i takes teacher layer
min(i, L_t − 1), so the teacher's last layer fills every extra student layer. DWT found this
*hurts* (random init is the default); it is here to reproduce that finding. Width is grown per
"space" of units — embedding E, hidden H (the residual stream), FFN I, attention inner A — in one
of two ways:

- ``net2wider`` (Net2WiderNet, Chen et al. 2016, with a deterministic cyclic map): student unit j
  copies teacher unit j mod n_t (attention copies whole heads when head_dim is equal). Weights
  leaving a copied unit are divided by its number of copies, so sums downstream are unchanged.
  Exactly function-preserving for Linear→activation→Linear (any widths), hence for FFN widening.
  LayerNorm normalises over all units, so through the residual stream and the embeddings it is
  exact only when every teacher unit has the same number of copies (H_s, E_s multiples of H_t,
  E_t): then mean and variance are unchanged. Attention is exact only when head_dim is equal
  (whole heads are copied; otherwise q·k sums change). The MLM head's LayerNorm output feeds only
  the tied decoder, so its γ and β are divided by the copy count: the logits are unchanged even
  though the embedding matrix is shared. Copies get identical gradients; dropout (or training
  noise) is what breaks the symmetry.
- ``zero``: the teacher's weights in the leading block; weights from new input units into the
  teacher's units are zero (so new units do not disturb the old ones' pre-activations); everything
  else keeps the student's random init. LayerNorm statistics still see the new units, so this is
  not function-preserving.

Vocabulary, positions, token types, position encoding and Admin-ness must match.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megakd.models.electra import MaskedLM

OUT, IN = "out", "in"  # a dim whose units are copied / a dim whose copies split the original weight
WIDTH_MODES = ("net2wider", "zero")

# Per parameter (layer parameters without their "encoder.layers.N." prefix): one entry per dim,
# (space, role) or None for a dim that must match exactly (vocabulary, positions, buckets).
_LAYER_DIMS: dict[str, tuple] = {
    "attention_omega": (("H", OUT),),
    "ffn_omega": (("H", OUT),),
    **{f"attention.{p}.weight": (("A", OUT), ("H", IN)) for p in ("query", "key", "value")},
    **{f"attention.{p}.bias": (("A", OUT),) for p in ("query", "key", "value")},
    "attention.output.weight": (("H", OUT), ("A", IN)),
    "attention.output.bias": (("H", OUT),),
    "attention_norm.weight": (("H", OUT),),
    "attention_norm.bias": (("H", OUT),),
    "ffn.fc_in.weight": (("I", OUT), ("H", IN)),
    "ffn.fc_in.bias": (("I", OUT),),
    "ffn.fc_out.weight": (("H", OUT), ("I", IN)),
    "ffn.fc_out.bias": (("H", OUT),),
    "ffn_norm.weight": (("H", OUT),),
    "ffn_norm.bias": (("H", OUT),),
}
_OTHER_DIMS: dict[str, tuple] = {
    "encoder.embeddings.word_embeddings.weight": (None, ("E", OUT)),
    "encoder.embeddings.position_embeddings.weight": (None, ("E", OUT)),
    "encoder.embeddings.token_type_embeddings.weight": (None, ("E", OUT)),
    "encoder.embeddings.layer_norm.weight": (("E", OUT),),
    "encoder.embeddings.layer_norm.bias": (("E", OUT),),
    "encoder.embeddings.embeddings_project.weight": (("H", OUT), ("E", IN)),
    "encoder.embeddings.embeddings_project.bias": (("H", OUT),),
    "encoder.relative_bias.relative_attention_bias.weight": (None, ("N", OUT)),
    "head.dense.weight": (("E", OUT), ("H", IN)),
    "head.dense.bias": (("E", OUT),),
    "head.layer_norm.weight": (("E", IN),),  # feeds only the tied decoder: split, logits unchanged
    "head.layer_norm.bias": (("E", IN),),
    "head.bias": (None,),
}
_MUST_MATCH = ("vocab_size", "max_position_embeddings", "type_vocab_size", "position_encoding", "relative_buckets",
               "relative_max_distance", "init", "pad_token_id")


def cyclic_map(teacher_size: int, student_size: int, group: int = 1) -> Tensor:
    """Student unit j ← teacher unit: j mod n_t, or whole groups (attention heads of `group` dims) cyclically."""
    j = torch.arange(student_size)
    return (j // group) % (teacher_size // group) * group + j % group


def net2wider(tensor: Tensor, dims: tuple) -> Tensor:
    """Widen `tensor` along each dim given as (index map [n_s], role); None leaves a dim as is.

    OUT dims copy units (`index_select`); IN dims also divide each copy by its unit's copy count,
    so a layer summing over that dim computes the same value from the widened input.
    """
    out = tensor
    for d, spec in enumerate(dims):
        if spec is None:
            continue
        index, role = spec
        out = out.index_select(d, index)
        if role == IN:
            count = torch.bincount(index, minlength=tensor.shape[d]).to(out.dtype)
            shape = [1] * out.ndim
            shape[d] = -1
            out = out / count[index].view(shape)
    return out


def zero_pad(tensor: Tensor, student_init: Tensor, dims: tuple) -> Tensor:
    """The teacher's `tensor` in the leading block of `student_init`; entries from new IN units to old units zero."""
    out = student_init.clone()
    out[tuple(slice(0, n) for n in tensor.shape)] = tensor
    for d, spec in enumerate(dims):
        if spec is None or spec[1] != IN:
            continue
        index = [slice(0, n) if other is not None and other[1] == OUT else slice(None)
                 for n, other in zip(tensor.shape, dims)]
        index[d] = slice(tensor.shape[d], None)
        out[tuple(index)] = 0
    return out


def _space_sizes(model: MaskedLM) -> dict[str, int]:
    c = model.config
    return {"E": c.embed_dim, "H": c.hidden_size, "I": c.intermediate_size, "A": c.hidden_size, "N": c.num_heads}


@torch.no_grad()
def remap_masked_lm(teacher: MaskedLM, student: MaskedLM, width: str = "net2wider") -> None:
    """Overwrite `student`'s parameters from `teacher`: depth by repeat-last, width by `width` (see module doc)."""
    if width not in WIDTH_MODES:
        raise ValueError(f"distill.remap_width: expected one of {', '.join(WIDTH_MODES)}, got {width!r}")
    tc, sc = teacher.config, student.config
    for name in _MUST_MATCH:
        if getattr(tc, name) != getattr(sc, name):
            raise ValueError(f"remap: teacher and student must have equal model.{name}, "
                             f"got {getattr(tc, name)!r} and {getattr(sc, name)!r}")
    if (tc.embed_dim == tc.hidden_size) != (sc.embed_dim == sc.hidden_size):
        raise ValueError("remap: teacher and student must both have or both lack an embeddings_project "
                         f"(embedding_size {tc.embedding_size} vs hidden_size {tc.hidden_size}, "
                         f"{sc.embedding_size} vs {sc.hidden_size})")
    t_sizes, s_sizes = _space_sizes(teacher), _space_sizes(student)
    for space, key in (("H", "hidden_size"), ("E", "embedding_size"), ("I", "intermediate_size"), ("N", "num_heads")):
        if s_sizes[space] < t_sizes[space]:
            raise ValueError(f"remap: the student's model.{key} ({s_sizes[space]}) is smaller than the teacher's "
                             f"({t_sizes[space]}); remapping only widens")
    t_head, s_head = tc.hidden_size // tc.num_heads, sc.hidden_size // sc.num_heads
    maps = {space: cyclic_map(t_sizes[space], s_sizes[space]) for space in ("E", "H", "I", "N")}
    maps["A"] = cyclic_map(tc.hidden_size, sc.hidden_size, group=t_head if t_head == s_head else 1)
    t_params = dict(teacher.named_parameters())
    for name, param in student.named_parameters():  # the tied decoder is listed once, as word_embeddings
        if name.startswith("encoder.layers."):
            index, rest = name[len("encoder.layers."):].split(".", 1)
            source = f"encoder.layers.{min(int(index), tc.num_layers - 1)}.{rest}"
            dims = _LAYER_DIMS[rest]
        else:
            source, dims = name, _OTHER_DIMS[name]
        value = t_params[source]
        specs = tuple(None if dim is None else (maps[dim[0]], dim[1]) for dim in dims)
        for d, spec in enumerate(specs):
            if spec is None and value.shape[d] != param.shape[d]:
                raise ValueError(f"remap: {name} has shape {list(param.shape)} but the teacher's {source} has "
                                 f"{list(value.shape)}")
        new = net2wider(value, specs) if width == "net2wider" else zero_pad(value, param, specs)
        param.copy_(new.to(param.dtype))

"""Laws the decoding tests check against the model's own full-context forward."""

from __future__ import annotations


def ranks_under_full_context(hf_model, prompt_ids, tokens) -> list[int]:
    """The rank of each generated token (0 = the argmax) in the full-context logits that predict
    it: one Hugging Face forward over the prompt plus the generated tokens."""
    import torch

    ids = torch.tensor([list(prompt_ids) + list(tokens)], dtype=torch.long)
    with torch.inference_mode():
        logits = hf_model(ids).logits[0, len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(tokens)]
    t = torch.tensor(list(tokens), dtype=torch.long)
    chosen = logits.gather(1, t[:, None])
    return (logits > chosen).sum(-1).tolist()

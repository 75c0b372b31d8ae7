"""Convert the bundled SmolLM2 GGUF file into a plain Hugging Face folder (run as a subprocess).

`python -m kapc.convert GGUF DEST [--weights]`. Without --weights only the tokenizer, chat template
and config are written (what the compiler needs). With --weights the dequantised model is rebuilt
as a plain `LlamaForCausalLM` and saved as safetensors (`save_pretrained` refuses the GGUF-quantised
object itself), which both the reference executor and vLLM load.
Runs in its own process so that the compiler never imports torch or transformers.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path


def convert(gguf: Path, dest: Path, weights: bool) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoTokenizer

    dest.mkdir(parents=True, exist_ok=True)
    src, fname = str(gguf.parent), gguf.name
    if not (dest / "tokenizer.ok").exists():
        tmp = Path(tempfile.mkdtemp(dir=dest.parent))
        AutoTokenizer.from_pretrained(src, gguf_file=fname).save_pretrained(tmp)
        config = AutoConfig.from_pretrained(src, gguf_file=fname)
        # Write the config exactly as the weights step's save_pretrained will, so config.json
        # does not change when the weights arrive later.
        config.architectures = ["LlamaForCausalLM"]
        config.dtype = "float32"
        config.save_pretrained(tmp)
        for f in tmp.iterdir():
            f.replace(dest / f.name)
        tmp.rmdir()
        (dest / "tokenizer.ok").write_text(fname + "\n")
    if weights and not (dest / "weights.ok").exists():
        import torch
        from transformers import AutoModelForCausalLM, LlamaForCausalLM

        quantised = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname, dtype=torch.float32)
        config = AutoConfig.from_pretrained(dest)
        plain = LlamaForCausalLM(config).to(torch.float32)
        missing, unexpected = plain.load_state_dict(quantised.state_dict(), strict=False)
        # With tied embeddings lm_head.weight may be absent from the GGUF state dict.
        missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
        if missing or unexpected:
            raise SystemExit(f"state dict mismatch: missing={missing} unexpected={unexpected}")
        plain.save_pretrained(dest, safe_serialization=True)
        (dest / "weights.ok").write_text(fname + "\n")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(args) != 2:
        raise SystemExit("usage: python -m kapc.convert GGUF DEST [--weights]")
    convert(Path(args[0]), Path(args[1]), "--weights" in sys.argv)

"""A model folder with a model's config and tokenizer and random weights, for a machine the
model cannot travel to: the device machine takes 64 MiB per call, the packaged GGUF is
94 MB. A step's time does not depend on the weights' values (bench/engine.py decodes
greedily with EOS ignored, to fixed lengths).

    python bench/random_model.py --no-weights OUT      # here: config + tokenizer (~4 MB)
    python bench/random_model.py --source OUT MODEL    # there: the same, random weights

--source defaults to the packaged SmolLM2-135M-Instruct (converted from its GGUF).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.model_files import resolve_model  # noqa: E402

# What a folder needs besides the weights (those present are copied).
FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--source", default="", help="model folder (default: the packaged model)")
    p.add_argument("--no-weights", action="store_true", help="config and tokenizer only")
    args = p.parse_args()
    source = Path(resolve_model(args.source))
    args.out.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        if (source / name).is_file() and source.resolve() != args.out.resolve():
            shutil.copy(source / name, args.out / name)
    if args.no_weights:
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.out))
    model.save_pretrained(args.out)
    sys.stderr.write(f"random-weight {model.config.model_type} model in {args.out}\n")


if __name__ == "__main__":
    main()

"""Write a random-weight Orpheus checkpoint in the published formats.

    python scripts/make_orpheus_checkpoint.py --config orpheus-tiny --out checkpoints/orpheus-tiny

writes ``OUT/llm`` (an HF Llama directory: config.json + model.safetensors) and ``OUT/snac``
(a SNAC directory: config.json + pytorch_model.bin). The same seed writes the same weights.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mstar.zoo.orpheus import ORPHEUS_CONFIGS, get_orpheus_config, make_random_checkpoint


def _size(directory: Path) -> str:
    total = sum(p.stat().st_size for p in directory.iterdir() if p.is_file())
    return f"{total / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments and write the checkpoint."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    choices = sorted(name for name in ORPHEUS_CONFIGS if name != "orpheus-3b")
    parser.add_argument("--config", choices=choices, default="orpheus-tiny")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    config = make_random_checkpoint(get_orpheus_config(args.config), args.out, seed=args.seed)
    assert config.llm_dir is not None and config.snac_dir is not None
    print(f"{args.config} (seed {args.seed}) in {time.perf_counter() - start:.1f} s:")
    print(f"  llm  {config.llm_dir}  {_size(config.llm_dir)}")
    print(f"  snac {config.snac_dir}  {_size(config.snac_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

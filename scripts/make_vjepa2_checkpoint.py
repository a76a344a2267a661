"""Write a random-weight V-JEPA 2-AC checkpoint in the published layout.

    python scripts/make_vjepa2_checkpoint.py --config vjepa2-small --out checkpoints/vjepa2-small.pt

writes one ``.pt`` file holding ``{"encoder": ..., "predictor": ...}`` state dicts under the
upstream parameter names (as ``vjepa2-ac-vitg.pt``), initialised as upstream initialises
(truncated normal, std 0.02, block output projections rescaled). The same seed writes the
same weights. Serve it with ``VJepa2Model(config, checkpoint=OUT)``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mstar.zoo.vjepa2 import (
    VJEPA2_CONFIGS,
    get_vjepa2_config,
    load_encoder,
    load_predictor,
    make_random_checkpoint,
    read_part,
)


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, write the checkpoint and load it back as a check."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", choices=sorted(VJEPA2_CONFIGS), default="vjepa2-tiny")
    parser.add_argument("--out", type=Path, required=True, help="output .pt file")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = get_vjepa2_config(args.config)
    start = time.perf_counter()
    path = make_random_checkpoint(config, args.out, seed=args.seed)
    load_encoder(path, config)  # both load back: the file fits the config
    load_predictor(path, config)
    # Counted from the file: fused modules may hold packed weights outside `parameters()`.
    params = [
        sum(t.numel() for t in read_part(path, part).values()) for part in ("encoder", "predictor")
    ]
    print(
        f"{args.config} (seed {args.seed}) in {time.perf_counter() - start:.1f} s: {path} "
        f"({path.stat().st_size / 2**20:.1f} MiB; encoder {params[0] / 1e6:.1f} M, predictor "
        f"{params[1] / 1e6:.1f} M parameters)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

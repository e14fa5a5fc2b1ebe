"""Random-token conversations for the long-context device scripts: one shard of N
conversations of S tokens (ids below Qwen3's 151643), each with a 16-token "prompt" that
carries no loss, in the tokens plugin's format (scripts/prepare-data writes the same).
The step's cost does not depend on which ids they are.

    python3 bench/long_tokens.py S OUT_DIR [N]
"""
import os
import sys

import h5py
import numpy as np


def main(argv):
    if len(argv) not in (2, 3):
        sys.exit(__doc__)
    S, out = int(argv[0]), argv[1]
    n = int(argv[2]) if len(argv) == 3 else 3
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 151643, size=n * S, dtype=np.int32)
    mask = np.ones(n * S, dtype=np.uint8)
    for i in range(n):
        mask[i * S: i * S + 16] = 0
    with h5py.File(os.path.join(out, "shard-00000.h5"), "w") as f:
        f.create_dataset("tokens", data=tokens)
        f.create_dataset("loss_mask", data=mask)
        f.create_dataset("offsets", data=np.arange(n + 1, dtype=np.int64) * S)
        f.create_dataset("lines", data=np.arange(1, n + 1, dtype=np.int64))
        f.attrs.update(format="flashdraft-tokens-v1", vocab_size=151936, tokenizer="random ids",
                       source="bench/long_tokens.py")
    print(f"{n} conversations of {S} random tokens in {out}")


if __name__ == "__main__":
    main(sys.argv[1:])

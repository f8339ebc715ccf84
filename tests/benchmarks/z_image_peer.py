"""`make bench`'s Z-Image row: train_lora.py against diffusers' own train_dreambooth_lora_z_image.py on the tiny
random-init Z-Image (models/tiny-z-image, `make tiny-z-image`), as peer_bench.py runs every row: the same settings
(rank, targets: both scripts' defaults, steps, batch, learning rate, resolution, seed, Qwen3 prompt length, cached
latents), each a whole `accelerate launch` on the CPU, timed from start to exit, interleaved; then both LoRAs'
held-out loss. flux_peer.py's `fetch` copies the peer.

    python tests/benchmarks/z_image_peer.py run [--repeats 3] [--steps N]    # -> outputs/bench/z_image_peer.json, a row
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_bench import Row, main  # noqa: E402

SAME = {"--resolution": "32", "--train_batch_size": "8", "--max_train_steps": "600", "--learning_rate": "1e-3",
        "--rank": "4", "--seed": "0", "--max_sequence_length": "64", "--lr_scheduler": "constant",
        "--lr_warmup_steps": "0", "--checkpointing_steps": "100000", "--adam_weight_decay": "1e-4",
        "--mixed_precision": "no"}
ROW = Row(name="z_image_peer", title="Z-Image LoRA", peer="train_dreambooth_lora_z_image.py",
          base="models/tiny-z-image", pipeline="ZImagePipeline", family="z_image", same=SAME,
          make="make tiny-z-image data")

if __name__ == "__main__":
    main(ROW, __doc__)

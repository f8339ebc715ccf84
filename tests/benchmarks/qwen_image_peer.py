"""`make bench`'s Qwen-Image row: train_lora.py against diffusers' own train_dreambooth_lora_qwen_image.py on the tiny
random-init Qwen-Image (models/tiny-qwen-image, `make tiny-qwen-image`), as peer_bench.py runs every row: the same
settings (rank and alpha, targets: both scripts' defaults, steps, batch, learning rate, resolution, seed, prompt
length, cached latents), each a whole `accelerate launch` on the CPU, timed from start to exit, interleaved (the VAE
encodes the latent cache 8 images a call in both); then both LoRAs' held-out loss. The peer runs unchanged (its
check_min_version passes the pinned diffusers); flux_peer.py's `fetch` copies it.

    python tests/benchmarks/qwen_image_peer.py run [--repeats 3] [--steps N]   # -> outputs/bench/qwen_image_peer.json
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_bench import Row, main  # noqa: E402

SAME = {"--resolution": "32", "--train_batch_size": "8", "--max_train_steps": "600", "--learning_rate": "1e-3",
        "--rank": "4", "--lora_alpha": "4", "--seed": "0", "--max_sequence_length": "64",
        "--lr_scheduler": "constant", "--lr_warmup_steps": "0", "--checkpointing_steps": "100000",
        "--adam_weight_decay": "1e-4", "--max_grad_norm": "1.0", "--mixed_precision": "no"}
# ours encodes the cache 8 images a call, as the peer does with its batches: its own default is a quarter batch, for
# the memory of full-resolution images, and the 3-D VAE's calls cost much more than their images here
ROW = Row(name="qwen_image_peer", title="Qwen-Image LoRA", peer="train_dreambooth_lora_qwen_image.py",
          base="models/tiny-qwen-image", pipeline="QwenImagePipeline", family="qwen_image", same=SAME,
          ours=["--vae_encode_batch_size", SAME["--train_batch_size"]], family_latents=True,
          make="make tiny-qwen-image data")

if __name__ == "__main__":
    main(ROW, __doc__)

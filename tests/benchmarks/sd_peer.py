"""`make bench`'s Stable Diffusion row: train_lora.py against diffusers' own train_text_to_image_lora.py on the shipped
tiny SD base (assets/tiny-sd-digits), with the settings of `make train-lora BASE=assets/tiny-sd-digits` that both
scripts take (batch 16, 400 steps, learning rate 3e-3 constant, 32 px center crops, rank 8, both scripts' default
targets: the attention projections), both on the red-ink digits' train folder, no validation images; ours with
--cache_latents, as the demo (the peer has no cache). As peer_bench.py runs every row: each a whole `accelerate
launch` on the CPU, timed from start to exit, interleaved; then both LoRAs' held-out loss. flux_peer.py's `fetch`
copies the peer.

    python tests/benchmarks/sd_peer.py run [--repeats 3] [--steps N]    # -> outputs/bench/sd_peer.json, a row
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_bench import DATA, Row, main  # noqa: E402

SAME = {"--resolution": "32", "--center_crop": None, "--train_batch_size": "16", "--max_train_steps": "400",
        "--learning_rate": "3e-3", "--lr_scheduler": "constant", "--lr_warmup_steps": "0", "--rank": "8",
        "--seed": "0", "--checkpointing_steps": "100000", "--mixed_precision": "no"}
TRAIN = ["--train_data_dir", f"{DATA}/train"]  # (the peer reads every file under the folder it is given)
ROW = Row(name="sd_peer", title="SD LoRA", peer="train_text_to_image_lora.py", base="assets/tiny-sd-digits",
          pipeline="StableDiffusionPipeline", family="sd", same=SAME, ours_data=TRAIN, peer_data=TRAIN, peer_cache=[],
          make="make data")

if __name__ == "__main__":
    main(ROW, __doc__)

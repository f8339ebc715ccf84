"""`make bench`'s Flux row: train_lora.py against diffusers' own train_dreambooth_lora_flux.py on the tiny random-init
Flux.1 (models/tiny-flux, `make tiny-flux`), with the same settings (rank, targets: both scripts' defaults, steps,
batch, learning rate, resolution, seed, T5 length, guidance input, cached latents), as peer_bench.py runs every row:
each a whole `accelerate launch` on the CPU, timed from start to exit, interleaved; then both LoRAs' held-out loss.
`fetch` copies all of make bench-peers' diffusers scripts.

    python tests/benchmarks/flux_peer.py fetch --diffusers_repo PATH
    python tests/benchmarks/flux_peer.py run [--repeats 3] [--steps N]   # -> outputs/bench/flux_peer.json, a row
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_bench import Row, main  # noqa: E402

SAME = {"--resolution": "32", "--train_batch_size": "8", "--max_train_steps": "600", "--learning_rate": "1e-3",
        "--rank": "4", "--seed": "0", "--max_sequence_length": "64", "--guidance_scale": "3.5",
        "--lr_scheduler": "constant", "--lr_warmup_steps": "0", "--checkpointing_steps": "100000",
        "--adam_weight_decay": "1e-4", "--mixed_precision": "no"}
ROW = Row(name="flux_peer", title="Flux.1 LoRA", peer="train_dreambooth_lora_flux.py", base="models/tiny-flux",
          pipeline="FluxPipeline", family="flux", same=SAME, make="make tiny-flux data", fetch="all")

if __name__ == "__main__":
    main(ROW, __doc__)

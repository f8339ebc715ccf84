"""`make bench`'s FLUX.2 klein row: train_lora.py against diffusers' own train_dreambooth_lora_flux2_klein.py on the
tiny random-init FLUX.2 klein (models/tiny-flux2-klein, `make tiny-flux2-klein`), as peer_bench.py runs every row:
the same settings (rank, targets: both scripts' defaults, steps, batch, learning rate, resolution, seed, prompt
length, cached latents), each a whole `accelerate launch` on the CPU, timed from start to exit, interleaved; then both
LoRAs' held-out loss.

The peer runs unchanged (check_min_version passes at the pinned diffusers) with one flag beyond the shared ones:
`--text_encoder_out_layers 9 18 27`, the layers Flux2KleinPipeline embeds prompts with (and train_lora.py too). The
script's default, FLUX.2 dev's 10, 20, 30, would train on other embeddings than the pipeline samples with, and on the
tiny Qwen3 (28 layers) it stops at once (hidden_states[30] out of range).

    python tests/benchmarks/flux2_klein_peer.py fetch --diffusers_repo PATH
    python tests/benchmarks/flux2_klein_peer.py run [--repeats 3] [--steps N]   # -> outputs/bench/flux2_klein_peer.json
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_bench import Row, main  # noqa: E402

SAME = {"--resolution": "32", "--train_batch_size": "8", "--max_train_steps": "300", "--learning_rate": "1e-3",
        "--rank": "4", "--seed": "0", "--max_sequence_length": "64", "--lr_scheduler": "constant",
        "--lr_warmup_steps": "0", "--checkpointing_steps": "100000", "--adam_weight_decay": "1e-4",
        "--mixed_precision": "no"}
LAYERS = ["--text_encoder_out_layers", "9", "18", "27"]  # the pipeline's (the peer's default is dev's)
ROW = Row(name="flux2_klein_peer", title="FLUX.2 klein LoRA", peer="train_dreambooth_lora_flux2_klein.py",
          base="models/tiny-flux2-klein", pipeline="Flux2KleinPipeline", family="flux2_klein", same=SAME,
          peer_flags=LAYERS, family_latents=True, make="make tiny-flux2-klein data", fetch="one",
          source="SOURCE_flux2_klein.json")

if __name__ == "__main__":
    main(ROW, __doc__)

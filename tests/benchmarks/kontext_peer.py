"""`make bench`'s Kontext row: train_lora.py with reference images against diffusers' own
train_dreambooth_lora_flux_kontext.py on the tiny random-init Flux.1 (models/tiny-flux, `make tiny-flux`), which both
load as FluxKontextPipeline's parts, with the same pairs (each white-on-black digit the reference of its red-ink twin,
"make it red ink on paper"), settings (rank, both scripts' default targets, steps, batch, learning rate, resolution,
seed, T5 length, guidance input, cached latents), as peer_bench.py runs every row; the held-out loss denoises each
test target with its reference.

The pairs are one imagefolder both read (outputs/bench/kontext-pairs: the target's `file_name`, the reference's
`control_file_name`, the instruction in `text`): ours through --control_image_column control, the peer's through
--cond_image_column control. flux_peer.py's `fetch` copies the peer.

    python tests/benchmarks/kontext_peer.py run [--repeats 3] [--steps N]    # -> outputs/bench/kontext_peer.json, a row
"""
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from flux_peer import SAME as FLUX  # noqa: E402
from peer_bench import ROOT, Row, main  # noqa: E402

PAIRS = os.path.join("outputs", "bench", "kontext-pairs")
INSTRUCTION = "make it red ink on paper"
SAME = {**FLUX, "--caption_column": "text"}
# What the peer does by default, asked of ours: train on the latent distributions' mode (its --vae_encode_mode), and
# encode the cache a training batch at a time.
OURS = ["--vae_encode_mode", "mode", "--vae_encode_batch_size", SAME["--train_batch_size"]]


def write_pairs(root=os.path.join(ROOT, PAIRS)):
    """data/digits-red-ink's images as targets, data/digits' as their references (controls/), one imagefolder."""
    if os.path.isfile(os.path.join(root, "test", "metadata.jsonl")):
        return root
    shutil.rmtree(root + ".tmp", ignore_errors=True)
    for split in ("train", "test"):
        folder = os.path.join(root + ".tmp", split)
        os.makedirs(os.path.join(folder, "controls"))
        with open(os.path.join(ROOT, "data", "digits-red-ink", split, "metadata.jsonl")) as f:
            names = [json.loads(line)["file_name"] for line in f]
        with open(os.path.join(folder, "metadata.jsonl"), "w") as f:
            for name in names:
                shutil.copy(os.path.join(ROOT, "data", "digits-red-ink", split, name), os.path.join(folder, name))
                shutil.copy(os.path.join(ROOT, "data", "digits", split, name), os.path.join(folder, "controls", name))
                f.write(json.dumps({"file_name": name, "control_file_name": f"controls/{name}",
                                    "text": INSTRUCTION}) + "\n")
    os.replace(root + ".tmp", root)
    return root


ROW = Row(name="kontext_peer", title="FLUX.1 Kontext edit LoRA", peer="train_dreambooth_lora_flux_kontext.py",
          base="models/tiny-flux", pipeline="FluxKontextPipeline", family="flux", same=SAME,
          ours_data=["--train_data_dir", PAIRS, "--control_image_column", "control"], ours=OURS,
          peer_data=["--dataset_name", PAIRS, "--image_column", "image", "--cond_image_column", "control",
                     "--instance_prompt", INSTRUCTION],
          references=True, held_out_data=PAIRS, needs=["data/digits/train/metadata.jsonl",
                                                       "data/digits-red-ink/train/metadata.jsonl"],
          prepare=write_pairs, make="make tiny-flux data")

if __name__ == "__main__":
    main(ROW, __doc__)

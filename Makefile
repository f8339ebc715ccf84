# Every target depends on `install`, so `make <anything>` works on a fresh machine.
# CONFIG=  accelerate yaml (default: single_gpu.yaml when a GPU is visible, else cpu.yaml)
# ARGS=    extra flags for the script        OUTPUT=  output folder
# MAIN_PORT=  the port of a multi-process launch (accelerate's default: 29500)
# Several machines (accelerate_configs/multi_node.yaml; the same command on each, the main one first):
# MACHINE_RANK=  this machine's rank (0: the main one)   MAIN_IP=  the main machine's IP
# NUM_MACHINES=  how many machines   NUM_PROCESSES=  processes on all of them together (GPUs per machine x machines)
SHELL := /bin/bash
# Let Python cache compiled modules in .venv: without .pyc files every process compiles diffusers/transformers
# from source again (tens of seconds per process). The install skips compiling; the first run writes them.
unexport PYTHONDONTWRITEBYTECODE
VENV := .venv
PY := $(VENV)/bin/python
ACCELERATE := $(VENV)/bin/accelerate
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
CONFIG ?= $(if $(HAS_GPU),accelerate_configs/single_gpu.yaml,accelerate_configs/cpu.yaml)
# accelerate runs several CPU processes only with this variable set (see accelerate_configs/cpu_2proc.yaml).
# On CPU, glibc keeps freed memory instead of handing it back after each step and faulting it in again at the
# next (the VAE encode of train_lora.py without --cache_latents; see docs/performance.md).
CPU_MALLOC := MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=268435456
LAUNCH_ENV := $(if $(findstring cpu,$(notdir $(CONFIG))),ACCELERATE_USE_CPU=1 $(CPU_MALLOC),)
# `accelerate launch` through common/launch.py: a script's one error line stays the last word (no launcher traceback),
# and a Ctrl-C waits for the checkpoint the training processes write.
LAUNCH := $(LAUNCH_ENV) $(PY) -m common.launch --config_file $(CONFIG) \
  $(if $(MAIN_PORT),--main_process_port $(MAIN_PORT),) $(if $(MAIN_IP),--main_process_ip $(MAIN_IP),) \
  $(if $(MACHINE_RANK),--machine_rank $(MACHINE_RANK),) $(if $(NUM_MACHINES),--num_machines $(NUM_MACHINES),) \
  $(if $(NUM_PROCESSES),--num_processes $(NUM_PROCESSES),)
ARGS ?=
DIGITS := data/digits/train/metadata.jsonl

.PHONY: install install-extras install-deepspeed lint data env tiny-sd-base tiny-flux-base tiny-sdxl tiny-sd3 tiny-flux tiny-qwen-image train-text-to-image train-classifier train-ddpm sample-ddpm tiny-sd train-lora train-dreambooth sample-lora inspect test clean tiny-z-image tiny-flux2-klein tiny-flux2 tiny-wan tiny-wan-a14b

install: $(VENV)/.installed
$(VENV)/.installed: requirements.txt
	test -x $(PY) || python3 -m venv $(VENV)
	set -o pipefail; $(PY) -m pip install --quiet --disable-pip-version-check --no-compile -r requirements.txt \
	  2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
	touch $@

# The optional packages (requirements-extras.txt): bitsandbytes for --optimizer adamw8bit, on a CUDA GPU.
install-extras: install
	set -o pipefail; $(PY) -m pip install --quiet --disable-pip-version-check --no-compile \
	  -r requirements-extras.txt 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }

# DeepSpeed (accelerate_configs/deepspeed_zero2.yaml): not in requirements.txt; only `make test-engines` needs it here.
install-deepspeed: install
	set -o pipefail; $(PY) -m pip install --quiet --disable-pip-version-check --no-compile \
	  -r requirements-deepspeed.txt 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }

# The distributed engines end to end (tests/test_engines.py): train_lora.py under DeepSpeed ZeRO-2 and ZeRO-3 on
# DeepSpeed's CPU accelerator, one and two processes, and under FSDP with one process; about 10 minutes on 2 CPU cores.
# `make test` runs only that file's cheap checks: run this before submitting a change to the engines' code.
.PHONY: test-engines
test-engines: install-deepspeed
	ENGINE_TESTS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest -q -n 0 tests/test_engines.py $(ARGS)

RED_DIGITS := data/digits-red-ink/train/metadata.jsonl
CAPTION_DIGITS := data/digits-captions/0
RED_MASKS := data/digits-red-ink-masks/train
BLOT_DIGITS := data/digits-red-ink-blot-masks/train
data: $(DIGITS) $(RED_DIGITS) $(CAPTION_DIGITS) $(RED_MASKS) $(BLOT_DIGITS)
$(DIGITS) $(RED_DIGITS) $(CAPTION_DIGITS) $(RED_MASKS) $(BLOT_DIGITS): | install
	$(PY) -m demo.digits --output_dir data/digits --styled_dir data/digits-red-ink --captions_dir data/digits-captions \
	  --masks_dir data/digits-red-ink-masks

env: install
	$(ACCELERATE) env
	@echo "Makefile accelerate config here: $(CONFIG) $(if $(LAUNCH_ENV),(with $(LAUNCH_ENV)),)"

train-classifier: data
	$(LAUNCH) $(if $(LAUNCH_ENV),--num_cpu_threads_per_process 1,) train_classifier.py --train_data_dir data/digits \
	  --output_dir $(or $(OUTPUT),outputs/classifier) $(ARGS)

# Scored by the digits classifier when `make train-classifier` has written one (sample accuracy, Frechet distance).
train-ddpm: data
	$(LAUNCH) $(if $(LAUNCH_ENV),--num_cpu_threads_per_process 1,) train_ddpm.py --train_data_dir data/digits \
	  --class_column label --use_ema \
	  $(if $(wildcard outputs/classifier/config.json),--eval_classifier outputs/classifier,) \
	  --output_dir $(or $(OUTPUT),outputs/ddpm) $(ARGS)

sample-ddpm: install
	OMP_NUM_THREADS=1 $(PY) sample.py --model $(or $(OUTPUT),outputs/ddpm) --class_label all $(ARGS)

# A tiny random-init Stable Diffusion, built locally (nothing downloaded): for offline smoke runs, not pictures.
TINY_SD := models/tiny-sd/model_index.json
tiny-sd: $(TINY_SD)
$(TINY_SD): | install
	$(PY) -m demo.tiny_sd --output_dir models/tiny-sd

# The same for Stable Diffusion XL (two text encoders, pooled embedding, time ids): what the SDXL paths run on offline.
TINY_SDXL := models/tiny-sdxl/model_index.json
tiny-sdxl: $(TINY_SDXL)
$(TINY_SDXL): | install
	$(PY) -m demo.tiny_sd --architecture tiny-sdxl --output_dir models/tiny-sdxl

# The flow-matching transformers the same way (demo/tiny_flow.py): Stable Diffusion 3 (StableDiffusion3Pipeline: two
# CLIP encoders and T5) and Flux.1 (FluxPipeline, Flux.1-dev's guidance embedding: CLIP and T5), each with its
# transformer, a 16-channel VAE and the flow-matching scheduler; 32 px images, about 5 MB each.
TINY_SD3 := models/tiny-sd3/model_index.json
tiny-sd3: $(TINY_SD3)
$(TINY_SD3): | install
	$(PY) -m demo.tiny_sd --architecture tiny-sd3 --output_dir models/tiny-sd3

TINY_FLUX := models/tiny-flux/model_index.json
tiny-flux: $(TINY_FLUX)
$(TINY_FLUX): | install
	$(PY) -m demo.tiny_sd --architecture tiny-flux --output_dir models/tiny-flux

# Qwen-Image (QwenImagePipeline: its transformer, a 3-D causal VAE, a Qwen2.5-VL text encoder and a tokenizer written
# here; demo/tiny_qwen_image.py): 32 px images, about 3 MB.
TINY_QWEN_IMAGE := models/tiny-qwen-image/model_index.json
tiny-qwen-image: $(TINY_QWEN_IMAGE)
$(TINY_QWEN_IMAGE): | install
	$(PY) -m demo.tiny_qwen_image --output_dir models/tiny-qwen-image

# Z-Image (ZImagePipeline: its single-stream transformer, a Qwen3 text encoder with its chat template, Flux.1's VAE
# layout), the same way (demo/tiny_z_image.py); 32 px images, about 5.5 MB.
TINY_Z_IMAGE := models/tiny-z-image/model_index.json
tiny-z-image: $(TINY_Z_IMAGE)
$(TINY_Z_IMAGE): | install
	$(PY) -m demo.tiny_z_image --output_dir models/tiny-z-image

# Wan 2.1 text-to-video (WanPipeline: its 3-D transformer, UMT5, the 3-D causal VAE; demo/tiny_wan.py): 32 px clips
# of 4k + 1 frames, well under 1 MB.
TINY_WAN := models/tiny-wan/model_index.json
tiny-wan: $(TINY_WAN)
$(TINY_WAN): | install
	$(PY) -m demo.tiny_wan --output_dir models/tiny-wan
# Wan 2.2 A14B's layout: two experts (transformer, transformer_2) switched at boundary_ratio 0.875 (--wan_expert).
TINY_WAN_A14B := models/tiny-wan-a14b/model_index.json
tiny-wan-a14b: $(TINY_WAN_A14B)
$(TINY_WAN_A14B): | install
	$(PY) -m demo.tiny_wan --variant a14b --output_dir models/tiny-wan-a14b

# FLUX.2 (demo/tiny_flux2.py): klein (Flux2KleinPipeline: a Qwen3 text encoder) and dev (Flux2Pipeline: Mistral3,
# a guidance embedding), each with FLUX.2's transformer, its 2 x 2-patch VAE and the scheduler; 32 px, about 4 MB.
TINY_FLUX2_KLEIN := models/tiny-flux2-klein/model_index.json
tiny-flux2-klein: $(TINY_FLUX2_KLEIN)
$(TINY_FLUX2_KLEIN): | install
	$(PY) -m demo.tiny_flux2 --variant klein --output_dir models/tiny-flux2-klein

TINY_FLUX2 := models/tiny-flux2/model_index.json
tiny-flux2: $(TINY_FLUX2)
$(TINY_FLUX2): | install
	$(PY) -m demo.tiny_flux2 --variant dev --output_dir models/tiny-flux2

# The LoRA demo: the tiny base, the digits captions. One thread per CPU process: the models are small, and on a
# shared CPU several threads per process spin against each other (see docs/train_lora.md).
LORA_OUT = $(or $(OUTPUT),outputs/lora)
# The demo's size, learning rate and batch for the tiny base; with another base (--pretrained_model_name_or_path in
# ARGS) the script's own defaults: the base's native resolution, LR 1e-4, batch 16.
# The shipped base (assets/tiny-sd-digits), rebuilt from scratch: the VAE, then the UNet with train_text_to_image.py,
# then the measurement and the model card (demo/tiny_sd_base.py). About 25 min on 2 CPU cores.
BASE_WORK := $(or $(OUTPUT),outputs/tiny-sd-base)
BASE_VAE_ARGS ?=
BASE_UNET_ARGS := --pretrained_model_name_or_path $(BASE_WORK)/init --unet_config $(BASE_WORK)/init/unet_config.json \
  --train_data_dir data/digits --caption_column captions --cache_latents --caption_dropout_prob 0.1 --snr_gamma 5 \
  --use_ema --ema_max_decay 0.999 --train_batch_size 64 --max_train_steps 1600 --learning_rate 2e-3 \
  --lr_scheduler cosine --lr_warmup_steps 100 --checkpointing_steps 400 --validation_steps 400 \
  --validation_prompt "a handwritten digit seven" --output_dir $(BASE_WORK)/unet
BASE_DIR ?= assets/tiny-sd-digits
tiny-sd-base: data
	$(PY) -m demo.tiny_sd_base vae --output_dir $(BASE_WORK)/init $(BASE_VAE_ARGS)
	$(LAUNCH) $(if $(LAUNCH_ENV),--num_cpu_threads_per_process 1,) train_text_to_image.py $(BASE_UNET_ARGS) $(ARGS)
	$(PY) -m demo.tiny_sd_base finish --model $(BASE_WORK)/unet --init $(BASE_WORK)/init --output_dir $(BASE_DIR) \
	  $(BASE_FINISH_ARGS) --commands 'make data ;; python -m demo.tiny_sd_base vae --output_dir $(BASE_WORK)/init \
	  $(BASE_VAE_ARGS) ;; $(if $(LAUNCH_ENV),ACCELERATE_USE_CPU=1 ,)accelerate launch --config_file $(CONFIG) \
	  $(if $(LAUNCH_ENV),--num_cpu_threads_per_process 1 ,)train_text_to_image.py \
	  $(BASE_UNET_ARGS) $(ARGS) ;; python -m demo.tiny_sd_base finish --model $(BASE_WORK)/unet \
	  --init $(BASE_WORK)/init --output_dir $(BASE_DIR) $(BASE_FINISH_ARGS)'

# The shipped Flux.1-architecture base (assets/tiny-flux-digits), rebuilt from scratch: the starting pipeline (the SD
# base's VAE and CLIP, a random T5, the transformer's config), the transformer trained by flow matching with
# train_text_to_image.py, then the measurement and the model card (demo/tiny_flux_base.py). About 10 min on 2 CPU cores.
FLUX_WORK := $(or $(OUTPUT),outputs/tiny-flux-base)
FLUX_TRANSFORMER_ARGS := --pretrained_model_name_or_path $(FLUX_WORK)/init \
  --transformer_config $(FLUX_WORK)/init/transformer_config.json --train_data_dir data/digits \
  --caption_column captions --cache_latents --caption_dropout_prob 0.1 --use_ema --ema_max_decay 0.999 \
  --train_batch_size 64 --max_train_steps 1200 --learning_rate 1e-3 --lr_scheduler cosine --lr_warmup_steps 50 \
  --checkpointing_steps 400 --validation_steps 400 --validation_prompt "a handwritten digit seven" \
  --output_dir $(FLUX_WORK)/transformer
FLUX_BASE_DIR ?= assets/tiny-flux-digits
tiny-flux-base: data
	$(PY) -m demo.tiny_flux_base init --output_dir $(FLUX_WORK)/init
	$(LAUNCH) $(if $(LAUNCH_ENV),--num_cpu_threads_per_process 1,) train_text_to_image.py $(FLUX_TRANSFORMER_ARGS) $(ARGS)
	$(PY) -m demo.tiny_flux_base finish --model $(FLUX_WORK)/transformer --output_dir $(FLUX_BASE_DIR) \
	  $(FLUX_FINISH_ARGS) --commands 'make data ;; python -m demo.tiny_flux_base init --output_dir $(FLUX_WORK)/init ;; \
	  $(if $(LAUNCH_ENV),ACCELERATE_USE_CPU=1 ,)accelerate launch --config_file $(CONFIG) \
	  $(if $(LAUNCH_ENV),--num_cpu_threads_per_process 1 ,)train_text_to_image.py $(FLUX_TRANSFORMER_ARGS) $(ARGS) ;; \
	  python -m demo.tiny_flux_base finish --model $(FLUX_WORK)/transformer --output_dir $(FLUX_BASE_DIR) \
	  $(FLUX_FINISH_ARGS)'

# The shipped Wan-architecture video base (assets/tiny-wan-digits), rebuilt from scratch: clips of digits moving left
# (demo/moving_digits.py), the VAE and the starting pipeline, the transformer trained by flow matching on the clips with
# train_text_to_image.py, then the measurement and the model card (demo/tiny_wan_base.py).
WAN_WORK := $(or $(OUTPUT),outputs/tiny-wan-base)
LEFT_CLIPS := data/moving-digits-left
RIGHT_CLIPS := data/moving-digits-right
$(LEFT_CLIPS)/0000.txt: | install
	$(PY) -m demo.moving_digits --output_dir $(LEFT_CLIPS) --count 1500 --speed 2 --format gif --direction left
$(RIGHT_CLIPS)/0000.txt: | install
	$(PY) -m demo.moving_digits --output_dir $(RIGHT_CLIPS) --count 500 --speed 2 --format gif --direction right \
	  --seed 1
WAN_TRANSFORMER_ARGS := --pretrained_model_name_or_path $(WAN_WORK)/init \
  --transformer_config $(WAN_WORK)/init/transformer_config.json --train_data_dir $(LEFT_CLIPS) --num_frames 9 \
  --resolution 32 --buckets auto --cache_latents --caption_dropout_prob 0.1 --use_ema --ema_max_decay 0.999 \
  --train_batch_size 64 --max_train_steps 4000 --learning_rate 1e-3 --lr_scheduler cosine --lr_warmup_steps 50 \
  --checkpointing_steps 1000 --validation_steps 1000 --validation_prompt "a handwritten digit 7 moving left" \
  --output_dir $(WAN_WORK)/transformer
WAN_BASE_DIR ?= assets/tiny-wan-digits
tiny-wan-base: $(LEFT_CLIPS)/0000.txt
	OMP_NUM_THREADS=1 $(PY) -m demo.tiny_wan_base vae --output_dir $(WAN_WORK)/init $(WAN_VAE_ARGS)
	$(LAUNCH) $(if $(LAUNCH_ENV),--num_cpu_threads_per_process 1,) train_text_to_image.py $(WAN_TRANSFORMER_ARGS) $(ARGS)
	OMP_NUM_THREADS=1 $(PY) -m demo.tiny_wan_base finish --model $(WAN_WORK)/transformer --init $(WAN_WORK)/init \
	  --output_dir $(WAN_BASE_DIR) $(WAN_FINISH_ARGS) --commands 'python -m demo.moving_digits \
	  --output_dir $(LEFT_CLIPS) --count 1500 --speed 2 --format gif --direction left ;; python -m demo.tiny_wan_base \
	  vae --output_dir $(WAN_WORK)/init $(WAN_VAE_ARGS) ;; $(if $(LAUNCH_ENV),ACCELERATE_USE_CPU=1 ,)accelerate launch \
	  --config_file $(CONFIG) $(if $(LAUNCH_ENV),--num_cpu_threads_per_process 1 ,)train_text_to_image.py \
	  $(WAN_TRANSFORMER_ARGS) $(ARGS) ;; python -m demo.tiny_wan_base finish --model $(WAN_WORK)/transformer \
	  --init $(WAN_WORK)/init --output_dir $(WAN_BASE_DIR) $(WAN_FINISH_ARGS)'

# The video demo: a motion LoRA ("moving right", a motion the base never saw) on the shipped tiny Wan base, then
# demo/motion_eval.py measures it (the prompted digit and the drift of the ink, 100 clips) and writes preview.gif.
# LoRA on the feed-forward layers too: on the attention alone it learns the motion but loses the digits.
VIDEO_LORA_OUT = $(or $(OUTPUT),outputs/video-lora)
WAN_LORA_TARGETS := to_k,to_q,to_v,to_out.0,ffn.net.0.proj,ffn.net.2
VIDEO_LORA_ARGS := --pretrained_model_name_or_path assets/tiny-wan-digits --train_data_dir $(RIGHT_CLIPS) \
  --num_frames 9 --resolution 32 --buckets auto --cache_latents --rank 32 --target_modules $(WAN_LORA_TARGETS) \
  --learning_rate 1e-3 --train_batch_size 16 --max_train_steps 3200 \
  --validation_prompt "a handwritten digit 7 moving right" --output_dir $(VIDEO_LORA_OUT)
.PHONY: tiny-wan-base train-video-lora
train-video-lora: $(RIGHT_CLIPS)/0000.txt
	$(LAUNCH) $(if $(LAUNCH_ENV),--num_cpu_threads_per_process 1,) train_lora.py $(VIDEO_LORA_ARGS) $(ARGS)
	OMP_NUM_THREADS=1 $(PY) -m demo.motion_eval --lora $(VIDEO_LORA_OUT)
	@echo "LoRA: $(VIDEO_LORA_OUT)/pytorch_lora_weights.safetensors   preview: $(VIDEO_LORA_OUT)/preview.gif"

# Full fine-tuning of the shipped base's UNet on the red-ink digits (the LoRA demo's data), EMA exported.
train-text-to-image: data
	$(LAUNCH) $(if $(LAUNCH_ENV),--num_cpu_threads_per_process 1,) train_text_to_image.py \
	  --train_data_dir data/digits-red-ink --output_dir $(or $(OUTPUT),outputs/text-to-image) --cache_latents \
	  --use_ema --ema_max_decay 0.999 --learning_rate 1e-3 --train_batch_size 16 --max_train_steps 300 \
	  --validation_prompt "a handwritten digit seven, red ink on paper" --validation_steps 100 $(ARGS)

# The demo: a style LoRA (red ink on paper, a style the base never saw) on a shipped tiny base, then
# demo/style_report.py measures it and draws it side by side with the base. BASE= which one: assets/tiny-flux-digits
# (the default: Flux.1's architecture, LoRA on its default targets, 600 steps) or assets/tiny-sd-digits (a UNet: LoRA
# on the attention, feed-forward and convolution layers too, 400 steps; on the 1 M-parameter UNet, attention alone
# learns the colours but loses the digits). With a base of your own in ARGS (--pretrained_model_name_or_path ...),
# none of the demo's flags and a sample grid instead.
STYLE_PROMPT := "a handwritten digit seven, red ink on paper"
BASE ?= assets/tiny-flux-digits
DEMO_LORA = $(if $(findstring --pretrained_model_name_or_path,$(ARGS)),,yes)
SD_LORA_TARGETS := to_k,to_q,to_v,to_out.0,proj_in,proj_out,ff.net.0.proj,ff.net.2,conv1,conv2,conv_shortcut,conv_in,$\
  conv_out,time_emb_proj
BASE_LORA = $(if $(findstring tiny-sd-digits,$(BASE)),--max_train_steps 400 --target_modules $(SD_LORA_TARGETS),$\
  --max_train_steps 600)
LORA_DEMO = $(if $(DEMO_LORA),--pretrained_model_name_or_path $(BASE) --train_data_dir data/digits-red-ink \
  --learning_rate 3e-3 --train_batch_size 16 $(BASE_LORA) --caption_dropout_prob 0.1 --validation_prompt \
  $(STYLE_PROMPT) --validation_split 0.05)
LORA_PROMPTS := --prompt "a handwritten digit zero, red ink on paper" --prompt "a handwritten digit three, red ink on \
  paper" --prompt "a handwritten digit seven, red ink on paper"
train-lora: data
	$(LAUNCH) $(if $(LAUNCH_ENV),--num_cpu_threads_per_process 1,) train_lora.py --output_dir $(LORA_OUT) \
	  --cache_latents $(LORA_DEMO) $(ARGS)
	OMP_NUM_THREADS=$(if $(DEMO_LORA),2,1) $(PY) $(if $(DEMO_LORA),-m demo.style_report --lora $(LORA_OUT),sample.py --model $(LORA_OUT) \
	  $(LORA_PROMPTS) --num_images 4)
	@echo "LoRA: $(LORA_OUT)/pytorch_lora_weights.safetensors (lora_info.json, README.md, all_results.json)"
	@echo "validation images: $(LORA_OUT)/samples/step-*/$(if $(DEMO_LORA),   side by side: \
	  $(LORA_OUT)/side_by_side.png,   sample grid: $(LORA_OUT)/samples/grid.png)"

# DreamBooth: 20 red-ink sevens (data/dreambooth/instance) under "a handwritten digit seven, sks" with prior
# preservation: 100 class images of "a handwritten digit seven" that the base draws once into
# data/dreambooth/class-seven. Then demo/dreambooth.py measures the style with the token, without it and on the other
# digits. PRIOR=no: the same run without prior preservation (how far the style leaks).
DREAMBOOTH_OUT = $(or $(OUTPUT),outputs/dreambooth$(if $(filter no,$(PRIOR)),-no-prior,))
DREAMBOOTH_PRIOR = $(if $(filter no,$(PRIOR)),,--with_prior_preservation --class_data_dir data/dreambooth/class-seven \
  --class_prompt "a handwritten digit seven")
train-dreambooth: data
	$(PY) -m demo.dreambooth data
	$(LAUNCH) $(if $(LAUNCH_ENV),--num_cpu_threads_per_process 1,) train_lora.py --output_dir $(DREAMBOOTH_OUT) \
	  --pretrained_model_name_or_path $(BASE) $(if $(findstring tiny-sd-digits,$(BASE)),--target_modules \
	  $(SD_LORA_TARGETS),) --instance_data_dir data/dreambooth/instance --instance_prompt "a handwritten digit seven, sks" \
	  $(DREAMBOOTH_PRIOR) --learning_rate 3e-3 --train_batch_size 8 --max_train_steps 150 --cache_latents $(ARGS)
	OMP_NUM_THREADS=2 $(PY) -m demo.dreambooth report --lora $(DREAMBOOTH_OUT)

# The masked-loss demo (--masked_loss): the red-ink digits with an ink blot in a corner (data/digits-red-ink-blot),
# their masks leaving that corner out (data/digits-red-ink-blot-masks): the style is learned, the blot is not.
# MASKED=no: the same data without the masks (the blot is learned too). Measured as train-lora is, plus the share of
# samples with the blot (docs/train_lora.md, masked loss). ARGS= more flags, OUTPUT= its folder.
.PHONY: train-lora-masked
train-lora-masked: data
	$(MAKE) train-lora OUTPUT=$(or $(OUTPUT),outputs/lora-$(if $(filter no,$(MASKED)),blot,masked)) \
	  ARGS="--train_data_dir data/digits-red-ink-blot $(if $(filter no,$(MASKED)),,--masked_loss --mask_data_dir \
	  data/digits-red-ink-blot-masks) $(ARGS)"

# The edit-LoRA demo (FLUX.1 Kontext's way: common/references.py): each white-on-black digit of data/digits is the
# reference, the same-named red-ink digit of data/digits-red-ink the target, one instruction for all, naming no digit.
# On the shipped tiny Flux.1 base drawn as FluxKontextPipeline; then demo/edit_report.py measures, on held-out
# references (data/digits/test), whether the output keeps the reference's digit and is in red ink, base against
# LoRA, and draws reference | base | LoRA side by side. ARGS= more flags, OUTPUT= its folder.
EDIT_OUT = $(or $(OUTPUT),outputs/edit-lora)
EDIT_PROMPT := "make it red ink on paper"
.PHONY: train-edit-lora
train-edit-lora: data
	$(LAUNCH) $(if $(LAUNCH_ENV),--num_cpu_threads_per_process 1,) train_lora.py --output_dir $(EDIT_OUT) \
	  --pretrained_model_name_or_path assets/tiny-flux-digits --instance_data_dir data/digits-red-ink/train \
	  --instance_prompt $(EDIT_PROMPT) --control_data_dir data/digits/train --cache_latents --rank 16 \
	  --learning_rate 3e-3 --train_batch_size 16 --max_train_steps 600 --caption_dropout_prob 0.1 \
	  --validation_prompt $(EDIT_PROMPT) --validation_split 0.05 $(ARGS)
	OMP_NUM_THREADS=2 $(PY) -m demo.edit_report --lora $(EDIT_OUT)
	@echo "edit LoRA: $(EDIT_OUT)/pytorch_lora_weights.safetensors   reference | base | LoRA: $(EDIT_OUT)/side_by_side.png"
	@echo 'sample it: python sample.py --model $(EDIT_OUT) --image data/digits/test/0021.png --prompt $(EDIT_PROMPT)'

sample-lora: | install
	OMP_NUM_THREADS=1 $(PY) sample.py --model $(LORA_OUT) $(LORA_PROMPTS) --num_images 4 $(ARGS)

# What a pipeline holds and what one call does, stage by stage with shapes and times, plus the x0 trajectory.
# MODEL= another pipeline (a train_ddpm.py / train_lora.py output, a hub id); ARGS= e.g. --lora PATH, --json.
inspect: $(if $(MODEL),install,$(TINY_SD))
	OMP_NUM_THREADS=1 $(PY) inspect_pipeline.py $(or $(MODEL),models/tiny-sd) --trace --num_inference_steps 4 \
	  --save_trajectory $(or $(OUTPUT),outputs/inspect)/trajectory.png --trajectory_steps 4 $(ARGS)

# pyflakes, pycodestyle (120 columns) and import order, settings in pyproject.toml; `make test` runs it first.
lint: install
	$(PY) -m ruff check .

# Two test processes (pytest-xdist), one test module each at a time (tests/conftest.py's scheduler), each on one
# thread, as the single-threaded subprocesses that most tests run: on 2 cores, more threads only spin against each other.
TEST_WORKERS ?= 2
test: lint data
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup \
	  tests $(ARGS)

# Each recipe against a hand-written reference loop, --help latency, sample.py images/s (tests/benchmarks/):
# one table, and outputs/bench/results.json; then the SD, Flux.1, Qwen-Image, FLUX.2 klein, Z-Image and FLUX.1 Kontext
# (edit LoRA) rows against diffusers' own scripts (sd_peer.py, flux_peer.py, qwen_image_peer.py, flux2_klein_peer.py,
# z_image_peer.py, kontext_peer.py, on peer_bench.py; minutes each). About 5 min on 2 CPU cores (3 repeats), plus
# about 5 for lora_buckets and lora_square (aspect-ratio buckets against square crops); BENCH_ARGS="--repeats 1" for a
# quick look.
.PHONY: bench
BENCH_ARGS ?=
bench: data $(TINY_SD) $(TINY_FLUX) $(TINY_QWEN_IMAGE) $(TINY_FLUX2_KLEIN) $(TINY_Z_IMAGE)
	$(PY) tests/benchmarks/run_bench.py $(BENCH_ARGS)
	$(if $(wildcard .gpu-pack/peers/train_text_to_image_lora.py),$(PY) tests/benchmarks/sd_peer.py run,@echo "the SD \
	  row needs diffusers' own script: make bench-peers DIFFUSERS_REPO=<a clone of diffusers>")
	$(if $(wildcard .gpu-pack/peers/train_dreambooth_lora_flux.py),$(PY) tests/benchmarks/flux_peer.py run,@echo "the \
	  Flux row needs diffusers' own script: make bench-peers DIFFUSERS_REPO=<a clone of diffusers>")
	$(if $(wildcard .gpu-pack/peers/train_dreambooth_lora_qwen_image.py),$(PY) tests/benchmarks/qwen_image_peer.py run,\
	  @echo "the Qwen-Image row needs diffusers' own script: make bench-peers DIFFUSERS_REPO=<a clone of diffusers>")
	$(if $(wildcard .gpu-pack/peers/train_dreambooth_lora_flux2_klein.py),$(PY) tests/benchmarks/flux2_klein_peer.py \
	  run,@echo "the FLUX.2 klein row needs diffusers' own script: make bench-peers DIFFUSERS_REPO=<a clone of diffusers>")
	$(if $(wildcard .gpu-pack/peers/train_dreambooth_lora_z_image.py),$(PY) tests/benchmarks/z_image_peer.py run,@echo \
	  "the Z-Image row needs diffusers' own script: make bench-peers DIFFUSERS_REPO=<a clone of diffusers>")
	$(if $(wildcard .gpu-pack/peers/train_dreambooth_lora_flux_kontext.py),$(PY) tests/benchmarks/kontext_peer.py \
	  run,@echo "the Kontext row needs diffusers' own script: make bench-peers DIFFUSERS_REPO=<a clone of diffusers>")

# diffusers' example scripts, the peers of the Flux row (and of make gpu-evidence), at the pinned diffusers' tag (or
# the nearest below it), from a clone of its repository, into .gpu-pack/peers (ignored).
.PHONY: bench-peers
bench-peers: install
	$(PY) tests/benchmarks/flux_peer.py fetch --diffusers_repo "$(DIFFUSERS_REPO)"
	$(PY) tests/benchmarks/flux2_klein_peer.py fetch --diffusers_repo "$(DIFFUSERS_REPO)"

# On a GPU: train_lora.py on the Stable Diffusion 1.5 architecture (random weights, built on the GPU into
# models/sd15-random the first time) at 512 px, batch 1 and 4, fp16 and bf16, with and without gradient
# checkpointing, against its reference loop: steps/s, peak GPU memory, MFU; outputs/bench/gpu_results.json.
# About 9 min on one H100 (8 recipe runs of ~45 s, most of it start-up). BENCH_ARGS="--precisions bf16" etc.
# No install step (a GPU machine may have no network): the machine's own Python (.venv's where there is one) with
# the pack's wheels on PYTHONPATH where it lacks diffusers and datasets (docs/performance.md, GPU evidence).
.PHONY: bench-gpu bench-gpu-sdxl
bench-gpu:
	$(GPU_PY) tests/benchmarks/gpu_lora.py $(BENCH_ARGS)

# The same on SDXL's architecture (random weights, built into models/sdxl-random the first time) at 1024 px, bf16,
# batch 1 and 4, with and without gradient checkpointing; outputs/bench/gpu_sdxl_results.json.
bench-gpu-sdxl:
	$(GPU_PY) tests/benchmarks/gpu_lora.py --workload gpu_sdxl --output outputs/bench/gpu_sdxl_results.json $(BENCH_ARGS)

# On a GPU: the docs' GPU claims, by one device command of at most 9 minutes (tests/benchmarks/gpu_evidence.py; the
# pieces are workloads.toml's [gpu_evidence], in value order: a SD 1.5 against diffusers' script, eager then
# compiled; b FLUX.1-dev's memory modes against diffusers' QLoRA script; c SDXL, the optimizers, DeepSpeed/FSDP on one
# GPU; e SD3; f Wan 2.1 1.3B and Wan 2.2 A14B on clips). Each piece's result goes to tests/benchmarks/results/gpu-evidence/<piece>.json and the piece is skipped
# while it is there. PIECES=a-eager,c-engines  BUDGET=510 (start no piece that would not end within that many
# seconds, stop at its end)  ARGS=--rerun. It installs nothing (a GPU machine may have no network): `make
# gpu-evidence-pack` on a machine with one brings what is missing, and the preflight (`make gpu-evidence-preflight`,
# seconds) checks it against the machine's packages (docs/performance.md, GPU evidence). `make gpu-evidence-list`:
# each piece's state and what it lacks here.
.PHONY: gpu-evidence gpu-evidence-pack gpu-evidence-list gpu-evidence-report gpu-evidence-preflight
GPU_PY = $(if $(wildcard $(PY)),$(PY),python3)
gpu-evidence:
	$(GPU_PY) tests/benchmarks/gpu_evidence.py run $(if $(PIECES),--pieces $(PIECES),) \
	  $(if $(BUDGET),--budget_s $(BUDGET),) $(ARGS)

gpu-evidence-preflight:
	$(GPU_PY) tests/benchmarks/gpu_evidence.py preflight

gpu-evidence-list:
	$(GPU_PY) tests/benchmarks/gpu_evidence.py list

# The markdown of docs/performance.md's GPU evidence, from the result files.
gpu-evidence-report:
	$(GPU_PY) tests/benchmarks/gpu_evidence.py report

# What a GPU machine without the network lacks, into .gpu-pack/ (ignored by git): wheels for its Python (pip) and
# diffusers' peer scripts at the version requirements.txt pins (else the nearest tag below it) from DIFFUSERS_REPO, a
# clone of diffusers' repository. Says what it packed and what a device call carries in all (at most 64 MiB).
DIFFUSERS_REPO ?=
gpu-evidence-pack: install
	$(PY) tests/benchmarks/gpu_evidence.py pack --diffusers_repo "$(DIFFUSERS_REPO)"

clean:
	rm -rf outputs data models .pytest_cache

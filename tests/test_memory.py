"""Fitting a big base in less accelerator memory (common/block_swap.py, common/float8_base.py), on the shipped tiny
Flux.1 base (assets/tiny-flux-digits: 1 double-stream and 3 single-stream blocks; SD3's tiny layout too) and on the
CPU, where the "accelerator" is the CPU too and a block swap still copies every block's weights into a new buffer
before it runs.

- --blocks_to_swap gives bitwise the loss and the LoRA gradients of no swap (plain LoRA, DoRA, LoKr, an fp8 base, an
  nf4 one where bitsandbytes is installed; Flux.1 and SD3), with gradient checkpointing; each step copies each swapped
  block in once for the forward and once for the backward (the last one stays between them), into buffers that are
  not the host copy; between steps the model holds no weights of those blocks, and the host copies never change.
- --quantize_base fp8 replaces every frozen Linear of the blocks, gives a loss within 1 % of the unquantized base's
  (fp32 and bf16), LoRA gradients within 5 %, and a LoRA under the same names.
- train_lora.py end to end: a run with --quantize_base fp8 --blocks_to_swap 2 against one without either: the same
  file keys, the first step's loss within 1 % (then 2 %), a file that loads exactly on the fp32 base and on a bf16
  one (cast to bf16).
- One line for what cannot apply.
"""
import types

import pytest
import torch
from conftest import ROOT, assert_one_line_error, launch, logged_losses, run_script
from safetensors.torch import load_file

from common.block_swap import check_block_swap, swap_blocks
from common.cli import UserError
from common.families import family_module, flux
from common.float8_base import Float8Linear, check_float8, quantize_blocks, weight_bytes

BASE = ROOT / "assets" / "tiny-flux-digits"
# The fp8 base's loss against the unquantized base's, relative: same LoRA, same batch (measured 0.03-0.15 % on random
# latents, 0.39 % at the first step of a run); after a few steps at a high learning rate the runs part a little more.
FP8_TOLERANCE, FP8_RUN_TOLERANCE = 0.01, 0.02


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """In-process steps on one thread, as the scripts' CPU runs (two threads on two shared cores are slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# family: (latent channels, T5 width, pooled width) of its tiny denoiser: the shipped Flux.1 base's, SD3's tiny layout
INPUTS = {"flux": (4, 64, 32), "sd3": (16, 96, 80), "wan": (16, 32, 1)}  # (Wan: an image, one frame)


def tiny_denoiser(dtype=torch.float32, dora=False, fp8=False, nf4=False, swap=0, family="flux", adapter="lora"):
    """A tiny transformer of the family (Flux.1: the shipped base's; SD3: its tiny layout with 3 blocks, random
    weights), frozen, with LoRA on the family's default targets (its B weights not zero, so that every LoRA weight
    gets a gradient; or LyCORIS's LoKr) and gradient checkpointing; an fp8 or nf4 base; `swap` blocks swapped.
    -> (transformer, BlockSwap or None)."""
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel
    from peft import LoKrConfig, LoraConfig

    from demo.tiny_flow import tiny_configs

    module = family_module(family)
    torch.manual_seed(0)
    if family == "flux":
        model = FluxTransformer2DModel.from_pretrained(BASE / "transformer", torch_dtype=dtype)
    elif family == "wan":  # (demo/tiny_wan.py's layout, 3 blocks)
        from diffusers import WanTransformer3DModel

        from demo.tiny_wan import TINY
        model = WanTransformer3DModel(**dict(TINY["transformer"], num_layers=3)).to(dtype)
    else:
        model = SD3Transformer2DModel.from_config(dict(tiny_configs("sd3")["transformer"], num_layers=3)).to(dtype)
    model.requires_grad_(False)
    if nf4:
        to_nf4(model, module)
    targets = module.LORA_TARGETS.split(",")
    lora = LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", use_dora=dora, target_modules=targets)
    model.add_adapter(LoKrConfig(r=4, alpha=4, target_modules=targets) if adapter == "lokr" else lora)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.data = param.data.float() + 0.05 * torch.randn_like(param, dtype=torch.float32)
    if fp8:
        quantize_blocks(model, module.SWAP_BLOCKS, dtype, "cpu")
    model.enable_gradient_checkpointing()
    return model, swap_blocks(module, model, swap, "cpu") if swap else None


def to_nf4(model, module):
    """Every Linear of the blocks as bitsandbytes' 4-bit NF4 layer (what diffusers' BitsAndBytesConfig loads)."""
    import bitsandbytes as bnb

    for name in module.SWAP_BLOCKS:
        for block in getattr(model, name):
            for path, linear in [(p, m) for p, m in block.named_modules() if type(m) is torch.nn.Linear]:
                layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                          compute_dtype=torch.float32, quant_type="nf4")
                layer.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type="nf4")
                layer.bias = linear.bias
                parent, _, attr = path.rpartition(".")
                setattr(block.get_submodule(parent) if parent else block, attr, layer.to("cpu"))


def step(model, autocast=False, family="flux"):
    """One training step's loss and LoRA gradients on fixed inputs."""
    channels, text, pooled = INPUTS[family]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, channels, 8, 8, generator=g)
    cond = {"prompt_embeds": torch.randn(2, 7, text, generator=g),
            "pooled_prompt_embeds": torch.randn(2, pooled, generator=g)}
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        prediction = family_module(family).denoise(model, x, torch.tensor([100.0, 700.0]), cond)
        loss = (prediction - x).float().pow(2).mean()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("family,swap,kind", [("flux", 1, "lora"), ("flux", 4, "dora"), ("flux", 2, "fp8"),
                                             ("flux", 2, "lokr-fp8"), ("flux", 3, "nf4"), ("sd3", 3, "fp8"),
                                             ("wan", 2, "fp8")])
def test_block_swap_is_bitwise_no_swap_and_really_moves_the_blocks(family, swap, kind):
    if kind == "nf4":
        pytest.importorskip("bitsandbytes")
    options = {"dora": kind == "dora", "fp8": "fp8" in kind, "nf4": kind == "nf4", "family": family,
               "adapter": "lokr" if "lokr" in kind else "lora"}
    plain, _ = tiny_denoiser(**options)
    model, swapper = tiny_denoiser(**options, swap=swap)
    assert len(swapper.order) == swap
    host = {i: (block.buffer.data_ptr(), block.buffer.clone()) for i, block in swapper.host.items()}
    seen = []  # what each swapped block's weights are while it runs: not the host buffer, and not empty

    def record(index):
        def hook(module, args):
            start, end = host[index][0], host[index][0] + host[index][1].numel()
            ptrs = [getattr(owner, name).data_ptr() for owner, name in swapper.host[index].slots]
            seen.append(all(getattr(owner, name).numel() for owner, name in swapper.host[index].slots)
                        and not any(start <= ptr < end for ptr in ptrs))
        return hook

    for index in swapper.order:  # (after the swap's own pre-hook, which binds the weights)
        swapper.blocks[index].register_forward_pre_hook(record(index))
    for n in (1, 2):
        loss, grads = step(plain, family=family)
        swapped_loss, swapped_grads = step(model, family=family)
        assert torch.equal(loss, swapped_loss)
        assert grads.keys() == swapped_grads.keys() and all(torch.equal(grads[k], swapped_grads[k]) for k in grads)
        # each swapped block copied in for the forward, then for the backward (the last one kept between them)
        assert swapper.copies == n * (2 * swap - 1)
        assert not swapper.bound and all(getattr(owner, name).numel() == 0 for block in swapper.host.values()
                                         for owner, name in block.slots)
    assert seen and all(seen)
    assert all(block.buffer.data_ptr() == host[i][0] and torch.equal(block.buffer, host[i][1])
               for i, block in swapper.host.items())  # nothing written back
    assert swapper.bytes_copied == 2 * sum(block.buffer.numel() * (2 if i != swapper.order[-1] else 1)
                                           for i, block in swapper.host.items())


def test_fp8_base_is_close_and_keeps_the_names():
    from peft.utils import get_peft_model_state_dict

    for dtype, autocast in ((torch.float32, False), (torch.bfloat16, True)):
        plain, _ = tiny_denoiser(dtype)
        quantized, _ = tiny_denoiser(dtype, fp8=True)
        loss, grads = step(plain, autocast)
        fp8_loss, fp8_grads = step(quantized, autocast)
        assert abs(fp8_loss - loss) / loss < FP8_TOLERANCE
        flat, fp8_flat = (torch.cat([g[k].flatten() for k in sorted(g)]) for g in (grads, fp8_grads))
        assert (fp8_flat - flat).norm() / flat.norm() < 0.05
        assert get_peft_model_state_dict(quantized).keys() == get_peft_model_state_dict(plain).keys()
    layers = [m for name in flux.SWAP_BLOCKS for block in getattr(quantized, name) for m in block.modules()]
    assert not any(type(m) is torch.nn.Linear and not m.weight.requires_grad for m in layers)
    fp8 = [m for m in layers if isinstance(m, Float8Linear)]
    assert len(fp8) == 32 and all(m.weight_fp8.dtype == torch.float8_e4m3fn for m in fp8)
    assert weight_bytes(quantized) < 0.6 * weight_bytes(plain)


SD = ROOT / "assets" / "tiny-sd-digits"
BAD = {  # parsing the flags (a local base: its family is known then)
    "swap-without-checkpointing": ([BASE, "--blocks_to_swap", "1"], "--blocks_to_swap needs --gradient_checkpointing"),
    "swap-on-a-unet": ([SD, "--blocks_to_swap", "1", "--gradient_checkpointing"],
                       "--blocks_to_swap swaps a transformer's blocks", "UNet"),
    "fp8-on-a-unet": ([SD, "--quantize_base", "fp8"], "--quantize_base fp8", "UNet", "nf4"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line(case, digits, tmp_path):
    (base, *flags), *needles = BAD[case]
    assert_one_line_error(run_script("train_lora.py", "--pretrained_model_name_or_path", base, "--train_data_dir",
                                     digits, "--output_dir", tmp_path / "out", *flags), *needles)
    assert not (tmp_path / "out").exists()


def test_engines_too_many_blocks_and_torch_without_float8_are_one_line(monkeypatch):
    """In process (main's checks, once the accelerator is made: the UserError is one line as the cases above show):
    DeepSpeed and FSDP do not run on this machine, and this torch has float8."""
    from accelerate.utils import DistributedType

    args = types.SimpleNamespace(blocks_to_swap=5, quantize_base=None, gradient_checkpointing=True,
                                 pretrained_model_name_or_path=str(BASE), revision=None, cache_dir=None)
    with pytest.raises(UserError, match=r"--blocks_to_swap 5: the Flux.1 transformer of '.*' has 4 blocks \(1 "
                                        r"transformer_blocks and 3 single_transformer_blocks\); give at most 4$"):
        check_block_swap(args, flux, types.SimpleNamespace(distributed_type=DistributedType.NO))
    args.blocks_to_swap = 4
    check_block_swap(args, flux, types.SimpleNamespace(distributed_type=DistributedType.NO))

    for engine, name in ((DistributedType.DEEPSPEED, "DeepSpeed"), (DistributedType.FSDP, "FSDP")):
        for flags, said in (({"blocks_to_swap": 2}, "--blocks_to_swap does"),
                            ({"quantize_base": "fp8"}, "--quantize_base fp8 does"),
                            ({"blocks_to_swap": 2, "quantize_base": "fp8"}, "and --quantize_base fp8 do")):
            args = types.SimpleNamespace(**{"blocks_to_swap": None, "quantize_base": None, **flags})
            with pytest.raises(UserError, match=f"{said} not run under {name}, which shards"):
                check_block_swap(args, flux, types.SimpleNamespace(distributed_type=engine))
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(UserError, match="--quantize_base fp8 needs a torch with float8 types"):
        check_float8()


STEPS = ["--max_train_samples", "16", "--train_batch_size", "4", "--max_train_steps", "3", "--checkpointing_steps",
         "3", "--rank", "4", "--lora_alpha", "2", "--learning_rate", "1e-2", "--cache_latents", "--logging_steps",
         "1", "--gradient_checkpointing"]


@pytest.fixture(scope="module")
def runs(digits, tmp_path_factory):
    root = tmp_path_factory.mktemp("memory")
    for name, flags in (("plain", []), ("fp8-swap", ["--quantize_base", "fp8", "--blocks_to_swap", "2"])):
        launch("train_lora.py", "--pretrained_model_name_or_path", BASE, "--train_data_dir", digits, "--output_dir",
               root / name, *STEPS, *flags)
    return root


def test_fp8_and_swap_train_a_lora_that_loads_on_the_plain_base(runs):
    from diffusers import FluxPipeline
    from peft.utils import get_peft_model_state_dict

    plain, fp8 = (load_file(runs / name / "pytorch_lora_weights.safetensors") for name in ("plain", "fp8-swap"))
    assert plain.keys() == fp8.keys() and all(fp8[k].dtype == torch.float32 for k in fp8)
    losses, fp8_losses = logged_losses(runs / "plain"), logged_losses(runs / "fp8-swap")
    assert sorted(losses) == sorted(fp8_losses) == [1, 2, 3]
    assert abs(fp8_losses[1] - losses[1]) / losses[1] < FP8_TOLERANCE  # (the LoRA as initialised)
    assert all(abs(fp8_losses[s] - losses[s]) / losses[s] < FP8_RUN_TOLERANCE for s in losses)
    for dtype in (torch.float32, torch.bfloat16):
        pipe = FluxPipeline.from_pretrained(BASE, torch_dtype=dtype)
        pipe.load_lora_weights(runs / "fp8-swap", adapter_name="default")
        state = {f"transformer.{k}": v for k, v in get_peft_model_state_dict(pipe.transformer).items()}
        assert state.keys() == fp8.keys()
        assert all(torch.equal(state[k], fp8[k].to(dtype)) for k in fp8)  # (fp32: the file's values exactly)

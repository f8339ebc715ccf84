"""--quantize_base fp8: the frozen Linear layers of the denoiser's transformer blocks stored in float8 (e4m3fn), one
scale per output row, and cast up to the compute dtype layer by layer as the forward reaches them. Half a bf16 base's
memory for those weights, with plain torch (no fp8 matmul: the matmuls run in the compute dtype, on any GPU or CPU).

The layers are quantized after the adapters are added: each frozen nn.Linear inside the blocks (the base layer under
a LoRA layer, or a plain one) is replaced by a Float8Linear in place, so every module keeps its name: a LoRA trained
on this base is saved under the names of a bf16 run, and loads on a bf16 base. The weight is dequantized again in the
backward rather than kept (an autograd Function that saves the float8 weight, not the cast one). What the LoRA layers
read as the base's `weight` (DoRA's norm) is the dequantized weight.

Not torchao's float8 training (diffusers' FLUX.2 script's --do_fp8_training): that converts the *trained* Linear
layers to run their matmuls in fp8 on H100-class GPUs, for speed; this stores the *frozen* weights in fp8, for memory.
"""
import torch

from .cli import UserError

E4M3_MAX = 448.0  # the largest float8_e4m3fn value


def float8_dtype():
    return getattr(torch, "float8_e4m3fn", None)


def check_float8(device=None):
    """One line when this torch (or this device) cannot store float8_e4m3fn and cast it back."""
    dtype = float8_dtype()
    if dtype is None:
        raise UserError(f"--quantize_base fp8 needs a torch with float8 types (2.1 or later; this one is "
                        f"{torch.__version__}): upgrade torch, or use --quantize_base nf4 on a CUDA GPU")
    if device is not None:
        try:
            torch.ones(2, device=device).to(dtype).to(torch.float32)
        except (RuntimeError, TypeError) as err:
            raise UserError(f"--quantize_base fp8: this torch cannot cast float8 on {device} "
                            f"({str(err).splitlines()[0]}): leave it out, or use --quantize_base nf4") from None


def quantize(weight, compute_dtype):
    """-> (float8 weight, scale [out, 1] in compute_dtype): weight ≈ float8 weight (cast up) x scale, per row."""
    scale = (weight.detach().abs().amax(dim=1, keepdim=True).float() / E4M3_MAX).to(compute_dtype)
    scale = scale.clamp(min=torch.finfo(compute_dtype).tiny)
    scaled = (weight.detach().float() / scale.float()).clamp(-E4M3_MAX, E4M3_MAX)
    return scaled.to(float8_dtype()), scale


def dequantize(weight, scale):
    return weight.to(scale.dtype) * scale


class _Float8Linear(torch.autograd.Function):
    """linear(x, dequantized weight, bias), keeping the float8 weight for the backward, not the cast one. The weight
    and bias are frozen: the only gradient is the input's."""

    @staticmethod
    def forward(ctx, x, weight, scale, bias):
        out = torch.nn.functional.linear(x, dequantize(weight, scale), bias)  # (under autocast: in its dtype)
        ctx.save_for_backward(weight, scale)
        ctx.x_dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        weight, scale = ctx.saved_tensors
        w = dequantize(weight, scale)
        grad_x = grad.to(w.dtype).matmul(w) if ctx.needs_input_grad[0] else None
        return (None if grad_x is None else grad_x.to(ctx.x_dtype)), None, None, None


class Float8Linear(torch.nn.Module):
    """A frozen nn.Linear whose weight is stored as float8_e4m3fn with one scale per output row (compute dtype)."""

    def __init__(self, linear, compute_dtype, device=None):
        """From an nn.Linear, quantized on `device` (default: where its weight is) and left there."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scale = quantize(linear.weight.detach().to(device), compute_dtype)
        self.weight_fp8 = torch.nn.Parameter(weight, requires_grad=False)
        self.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
        self.bias = None if linear.bias is None else torch.nn.Parameter(
            linear.bias.detach().to(device, compute_dtype), requires_grad=False)

    @property
    def weight(self):
        """The dequantized weight (for whoever reads a base layer's weight, such as DoRA)."""
        return dequantize(self.weight_fp8, self.weight_scale)

    def forward(self, x):
        return _Float8Linear.apply(x, self.weight_fp8, self.weight_scale, self.bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, float8_e4m3fn x row scale"


def quantize_blocks(denoiser, block_lists, compute_dtype, device, host_blocks=()):
    """Replace every frozen nn.Linear inside the denoiser's `block_lists` (the family's SWAP_BLOCKS) by a
    Float8Linear, quantized on `device` and left there, or moved to the CPU for the blocks `host_blocks` (indices
    into the lists' blocks, one after the other: those --blocks_to_swap keeps in host memory). -> the number of layers
    replaced."""
    replaced = 0
    blocks = [block for name in block_lists for block in getattr(denoiser, name)]
    for index, block in enumerate(blocks):
        home = "cpu" if index in host_blocks else device
        targets = [(name, module) for name, module in block.named_modules()
                   if type(module) is torch.nn.Linear and not module.weight.requires_grad]
        for name, linear in targets:
            parent_name, _, attr = name.rpartition(".")
            parent = block.get_submodule(parent_name) if parent_name else block
            setattr(parent, attr, Float8Linear(linear, compute_dtype, device).to(home))
            replaced += 1
    return replaced


def weight_bytes(model):
    """The bytes of a model's parameters (what its weights hold in memory)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())

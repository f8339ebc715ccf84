"""--blocks_to_swap N: the frozen weights of N of the denoiser's transformer blocks live in host memory, and each is
copied to the accelerator just before its block runs, on a side stream while the blocks before it compute, then
dropped. For LoRA on a base that does not fit the accelerator's memory (Flux.1's 12 B in bf16 on a 24 GB card).

A family names its denoiser's lists of blocks, in the order the forward runs them (`SWAP_BLOCKS`, e.g. Flux.1's
("transformer_blocks", "single_transformer_blocks")); a family without (a UNet) cannot swap. The N blocks are spread
evenly over those lists, so that each copy has the blocks in between to hide behind. What moves is each block's frozen
tensors (every parameter that does not train: the base layers under the LoRA layers, biases, norms, the float8
weights and scales of --quantize_base fp8), packed in one pinned buffer per block, copied in one piece. What trains
(the LoRA weights) stays on the accelerator. Nothing is ever copied back: the host copy is the only one kept.

How the weights get there (module hooks, nothing in the model's code changes):
- forward: the denoiser's own pre-hook starts the first swapped block's copy; a swapped block's forward pre-hook
  waits for its copy and starts the next one's; its forward hook drops the weights (the last block's stay when a
  backward will follow: it is the first the backward needs);
- backward (needs --gradient_checkpointing: without it autograd would keep every block's weights alive until the
  backward, and nothing would be saved): a block's full backward pre-hook waits for its copy and starts the previous
  swapped block's, and drops the blocks whose backward is done; the recomputed forward finds its weights there; the
  end of the backward drops the rest.
On a CPU the "accelerator" is the CPU: the copies are real copies all the same (a new buffer each time, the host
buffer never handed out), with no side stream.
"""
from .cli import UserError

ALIGN = 256  # bytes: each tensor's offset in a block's buffer (aligned as the CUDA allocator aligns a tensor)


def add_block_swap_args(group):
    from .args import positive_int

    group.add_argument("--blocks_to_swap", type=positive_int, default=None,
                       help="Keep the frozen weights of this many of the transformer's blocks in host memory and copy "
                            "each in just before it runs (less accelerator memory, more host memory, some speed). "
                            "Transformer bases (SD3, Flux.1), with --gradient_checkpointing; not with DeepSpeed or "
                            "FSDP.")


def swap_lists(family):
    """The names of the denoiser's lists of blocks, in the order its forward runs them; () for none (a UNet)."""
    return tuple(getattr(family, "SWAP_BLOCKS", ()))


def check_block_swap_flags(args, family):
    """What --blocks_to_swap needs of the other flags and of the base's family (None: not known yet)."""
    if not getattr(args, "blocks_to_swap", None):
        return
    if not args.gradient_checkpointing:
        raise UserError("--blocks_to_swap needs --gradient_checkpointing (without it autograd keeps every block's "
                        "weights on the accelerator until the backward): add it")
    if family is not None and not swap_lists(family):
        raise UserError(f"--blocks_to_swap swaps a transformer's blocks, and {family.NAME} bases have a UNet: leave "
                        "it out")


def block_counts(family, path, revision=None, cache_dir=None):
    """{list name: number of blocks} of the base's denoiser, from its config alone (built with no weights)."""
    import importlib

    from accelerate import init_empty_weights

    from .base_models import component_configs

    config = component_configs(path, (family.DENOISER,), revision, cache_dir)[family.DENOISER]
    library, class_name = family.COMPONENTS[family.DENOISER]
    with init_empty_weights():
        denoiser = getattr(importlib.import_module(library), class_name).from_config(config)
    return {name: len(getattr(denoiser, name)) for name in swap_lists(family)}


def check_block_swap(args, family, accelerator):
    """One line for a --blocks_to_swap that cannot apply: more blocks than the base's transformer has, or an engine
    that shards the weights and places them itself (DeepSpeed, FSDP; nor --quantize_base fp8 there: they cast every
    weight to one dtype, float8 ones too). Right after the Accelerator is made: before anything loads or is written."""
    from accelerate.utils import DistributedType

    flags = [flag for flag, given in (("--blocks_to_swap", getattr(args, "blocks_to_swap", None)),
                                      ("--quantize_base fp8", getattr(args, "quantize_base", None) == "fp8")) if given]
    engines = {DistributedType.DEEPSPEED: "DeepSpeed", DistributedType.FSDP: "FSDP"}
    if flags and accelerator.distributed_type in engines:
        raise UserError(f"{' and '.join(flags)} do{'es' * (len(flags) == 1)} not run under "
                        f"{engines[accelerator.distributed_type]}, which shards the weights, places and casts them "
                        "itself: leave it out, or train with one process or DDP (accelerate_configs/single_gpu.yaml, "
                        "multi_gpu.yaml)")
    if not getattr(args, "blocks_to_swap", None):
        return
    check_block_swap_flags(args, family)
    counts = block_counts(family, args.pretrained_model_name_or_path, args.revision, args.cache_dir)
    total = sum(counts.values())
    if args.blocks_to_swap > total:
        lists = " and ".join(f"{n} {name}" for name, n in counts.items())
        raise UserError(f"--blocks_to_swap {args.blocks_to_swap}: the {family.NAME} transformer of "
                        f"'{args.pretrained_model_name_or_path}' has {total} blocks ({lists}); give at most {total}")


def spread(n, total):
    """n distinct block indices of range(total), evenly spaced (the middle of each of n equal stretches)."""
    return [(2 * i + 1) * total // (2 * n) for i in range(n)]


def frozen_tensors(block):
    """The block's tensors that do not train, as (owner, attribute) slots: each frozen parameter's data, and the
    tensors of a 4-bit weight's quantization state (bitsandbytes' absmax, code, ..., nested ones too)."""
    import torch

    seen, slots = set(), []
    for param in block.parameters():
        if param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        slots.append((param, "data"))
        state = getattr(param, "quant_state", None)
        while state is not None:  # (bitsandbytes' QuantState; `state2`: the quantized absmax's own state)
            slots += [(state, name) for name, value in vars(state).items() if isinstance(value, torch.Tensor)]
            state = getattr(state, "state2", None)
    return slots


class HostBlock:
    """One swapped block's frozen tensors: their bytes in one host buffer (pinned for a CUDA device), and where each
    lies in it. `views(buffer)`: each tensor as a view of a buffer of the same layout; `set(tensors)` puts them in
    the model."""

    def __init__(self, slots, pin):
        import torch

        self.slots, self.layout, offset = slots, [], 0
        tensors = [getattr(owner, name) for owner, name in slots]
        for tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            self.layout.append((offset, nbytes, tensor.dtype, tensor.shape))
            offset += -(-nbytes // ALIGN) * ALIGN
        self.buffer = torch.empty(offset, dtype=torch.uint8, pin_memory=pin)
        for tensor, (start, nbytes, _, _) in zip(tensors, self.layout):
            self.buffer[start:start + nbytes].copy_(tensor.detach().reshape(-1).view(torch.uint8))

    def views(self, buffer):
        return [buffer[start:start + nbytes].view(dtype).view(shape) for start, nbytes, dtype, shape in self.layout]

    def set(self, tensors):
        for (owner, name), tensor in zip(self.slots, tensors):
            setattr(owner, name, tensor)


class BlockSwap:
    """The hooks and state of one denoiser's block swap (see the module's docstring). `copies`: host-to-device copies
    made (one per block load), `bytes_copied` their size; `bound`: the swapped blocks whose weights are on the
    device now."""

    def __init__(self, denoiser, blocks, swapped, device):
        import torch

        self.blocks, self.device, self.order = blocks, torch.device(device), sorted(swapped)
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.host, self.placeholders = {}, {}
        for index in self.order:
            self.host[index] = HostBlock(frozen_tensors(blocks[index]), pin=cuda)
            self.placeholders[index] = [torch.empty(0, dtype=dtype, device=self.device)
                                        for _, _, dtype, _ in self.host[index].layout]
            self.host[index].set(self.placeholders[index])  # the block's weights leave the model: host copy only
        self.pending, self.bound, self.phase = {}, set(), "idle"
        self.copies, self.bytes_copied = 0, 0
        eager = torch.compiler.disable  # (a compiled model runs the hooks as they are: they move tensors)
        self.handles = [denoiser.register_forward_pre_hook(eager(self._denoiser_starts))]
        for index, block in enumerate(blocks):
            self.handles += [block.register_forward_pre_hook(eager(self._forward_pre(index))),
                             block.register_forward_hook(eager(self._forward_post(index))),
                             block.register_full_backward_pre_hook(eager(self._backward_pre(index)))]

    def host_bytes(self):
        return sum(host.buffer.numel() for host in self.host.values())

    def _start_copy(self, index):
        """Begin copying block `index`'s weights into a new device buffer (on the side stream)."""
        import torch

        if index is None or index in self.bound or index in self.pending:
            return
        source = self.host[index].buffer
        if self.stream is None:
            buffer = torch.empty_like(source, device=self.device)
            buffer.copy_(source)
            self.pending[index] = (buffer, None)
        else:
            with torch.cuda.stream(self.stream):
                buffer = torch.empty_like(source, device=self.device)
                buffer.copy_(source, non_blocking=True)
                self.pending[index] = (buffer, self.stream.record_event())
        self.copies += 1
        self.bytes_copied += source.numel()

    def _bind(self, index):
        """Block `index`'s weights usable by the compute stream: its copy waited for (started now if it was not)."""
        import torch

        if index in self.bound:
            return
        self._start_copy(index)
        buffer, event = self.pending.pop(index)
        if event is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(event)
            buffer.record_stream(compute)  # freed later: not reused before the compute stream is done with it
        self.host[index].set(self.host[index].views(buffer))
        self.bound.add(index)

    def _drop(self, index):
        self.host[index].set(self.placeholders[index])
        self.bound.discard(index)

    def _neighbour(self, index, step):
        """The next swapped block after `index` (step 1) or before it (step -1) in the forward's order, or None."""
        later = [i for i in self.order if (i - index) * step > 0]
        return (min(later) if step > 0 else max(later)) if later else None

    def _drop_all(self):
        for index in list(self.bound):
            self._drop(index)
        self.pending.clear()
        self.phase = "idle"

    def _denoiser_starts(self, module, args):
        self._drop_all()
        self.phase = "forward"
        self._start_copy(self.order[0])

    def _forward_pre(self, index):
        def hook(module, args):
            if index in self.host:
                self._bind(index)
                if self.phase == "forward":
                    self._start_copy(self._neighbour(index, 1))
        return hook

    def _forward_post(self, index):
        import torch

        def hook(module, args, output):
            # (a recomputed forward in the backward leaves them: the backward's hooks drop them)
            last_before_backward = index == self.order[-1] and torch.is_grad_enabled()
            if index in self.host and self.phase == "forward" and not last_before_backward:
                self._drop(index)
        return hook

    def _backward_pre(self, index):
        import torch

        def hook(module, grad_output):
            if self.phase != "backward":
                self.phase = "backward"
                torch.autograd.Variable._execution_engine.queue_callback(self._drop_all)  # at the backward's end
            for done in [i for i in self.bound if i > index]:  # their backward has run
                self._drop(done)
            if index in self.host:
                self._bind(index)
                self._start_copy(self._neighbour(index, -1))
        return hook


def swapped_blocks(family, denoiser, blocks_to_swap):
    """-> (the denoiser's blocks, in the order they run; the indices of the `blocks_to_swap` of them that swap)."""
    blocks = [block for name in swap_lists(family) for block in getattr(denoiser, name)]
    return blocks, spread(blocks_to_swap, len(blocks)) if blocks_to_swap else []


def swap_blocks(family, denoiser, blocks_to_swap, device):
    """Put the frozen weights of `blocks_to_swap` of the denoiser's blocks (family.SWAP_BLOCKS) in host memory, with
    the hooks that copy them in (the rest of the denoiser stays where it is: move it to `device` after). Call it
    once the adapters are added: what trains stays out of it. -> the BlockSwap."""
    import warnings

    # (the first block's inputs need no gradient: its backward pre-hook is all that fires, which is what it is for)
    warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect "
                                              "to module outputs since no inputs require gradients")
    return BlockSwap(denoiser, *swapped_blocks(family, denoiser, blocks_to_swap), device)

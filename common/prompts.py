"""Prompts to token ids (CLIP's 77 tokens, T5's --max_sequence_length) and the cache of every distinct prompt's
embeddings, computed once so that the frozen text encoders have nothing left to do during training."""
import os
import shutil
import tempfile

CACHE_LIMIT_GB = 4.0  # past this, the cache lives in memory-mapped files (T5 states: ~4 MiB a prompt at 512 tokens)


def clip_ids(tokenizer, prompts):
    """CLIP token ids [N, 77], padded and truncated as the pipelines tokenize."""
    return tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                     return_tensors="pt").input_ids


def t5_ids(tokenizer, prompts, max_sequence_length):
    """T5 token ids [N, max_sequence_length], as the SD3 and Flux pipelines tokenize."""
    return tokenizer(prompts, padding="max_length", max_length=max_sequence_length, truncation=True,
                     add_special_tokens=True, return_tensors="pt").input_ids


class PromptCache:
    """cache = PromptCache(embed, ids); cache[prompt_indices] -> {name: tensor [B, ...]} on the CPU.

    embed(ids) -> {name: tensor [n, ...]}: the family's encode_prompts on a chunk of `ids` (a list of token-id tensors
    [N, L], one per text encoder), run `batch_size` prompts at a time. Rows in `zero_rows` are zeros (a pipeline that
    samples the unconditional branch with zeros: the empty prompt's). Past `limit_gb`, the embeddings go to
    memory-mapped files in a temporary folder of this process (every process makes its own: no shared disk needed),
    unlinked as soon as they are mapped: the disk space goes back when the process ends, however it ends (a process of
    a multi-process run leaves through os._exit, without finalizers).
    """

    def __init__(self, embed, ids, batch_size=64, zero_rows=(), limit_gb=CACHE_LIMIT_GB):
        import numpy as np
        import torch

        count = len(ids[0])
        self.folder, self.tensors, self.dtypes = None, {}, {}
        for start in range(0, count, batch_size):
            with torch.no_grad():
                chunk = embed([x[start:start + batch_size] for x in ids])
            for name, value in chunk.items():
                value = value.detach().cpu()
                if name not in self.tensors:
                    shape, dtype = (count, *value.shape[1:]), value.dtype
                    self.dtypes[name] = dtype
                    if count * value[0].numel() * value.element_size() > limit_gb * 2**30:
                        self.folder = self.folder or tempfile.mkdtemp(prefix="prompt-cache-")
                        file = os.path.join(self.folder, f"{name}.npy")
                        self.tensors[name] = np.lib.format.open_memmap(file, mode="w+", dtype=_numpy_dtype(dtype),
                                                                       shape=shape)
                        os.remove(file)  # (the mapping keeps the data)
                    else:
                        self.tensors[name] = torch.empty(shape, dtype=dtype)
                rows = self.tensors[name]
                if isinstance(rows, torch.Tensor):
                    rows[start:start + len(value)] = value
                else:
                    rows[start:start + len(value)] = _as_numpy(value)
        for name, rows in self.tensors.items():
            for row in zero_rows:
                rows[row] = 0
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)
        self.count = count

    def __len__(self):
        return self.count

    @property
    def spilled(self):
        return self.folder is not None

    def __getitem__(self, indices):
        import torch

        indices = torch.as_tensor(indices).cpu()
        out = {}
        for name, rows in self.tensors.items():
            if isinstance(rows, torch.Tensor):
                out[name] = rows.index_select(0, indices)
            else:
                out[name] = torch.from_numpy(rows[indices.numpy()]).view(self.dtypes[name])
        return out

    def close(self):
        """Let go of the embeddings (the memory-mapped files' space with them)."""
        self.tensors = {}


def _numpy_dtype(dtype):
    """numpy has no bfloat16: its bits are kept as int16 (and viewed back); integers (attention masks) as they are."""
    import numpy as np
    import torch

    if not dtype.is_floating_point:
        return torch.empty((), dtype=dtype).numpy().dtype
    return {torch.bfloat16: np.int16, torch.float16: np.float16}.get(dtype, np.float32)


def _as_numpy(value):
    import torch

    if value.dtype == torch.bfloat16:
        return value.view(torch.int16).numpy()
    return value.numpy() if value.dtype == torch.float16 or not value.dtype.is_floating_point else value.float().numpy()


class Conditioning:
    """cond = Conditioning(family, parts, prompts, ...); cond(prompt_ids, image_ids, data) -> the family denoiser's
    conditioning {name: tensor on `device`} for prompts given by index into `prompts` (SDXL: with each image's time
    ids, from `data`).

    Every prompt is embedded once (PromptCache) unless `cache` is False (the text encoders train: then they embed
    each batch; give the prepared ones to `use_encoders`). zero_empty: the pipeline samples the unconditional branch
    with zeros instead of the embedding of "" (SDXL's force_zeros_for_empty_prompt), so caption dropout trains on
    zeros too.
    """

    def __init__(self, family, parts, prompts, max_sequence_length, device, zero_empty=False, cache=True):
        self.family, self.parts, self.device, self.encoders = family, parts, device, {}
        self.ids = family.tokenize(parts, prompts, max_sequence_length)
        self.index = {prompt: i for i, prompt in enumerate(prompts)}
        self.zero_rows = [self.index[""]] if zero_empty and "" in self.index else []
        self.cache = PromptCache(self.embed, self.ids, zero_rows=self.zero_rows) if cache else None

    def use_encoders(self, encoders):
        """{name: text encoder} to embed with instead of the pipeline's (the trained, prepared ones)."""
        self.encoders = dict(encoders)

    def embed(self, ids):
        return self.family.encode_prompts({**self.parts, **self.encoders}, [x.to(self.device) for x in ids])

    def __call__(self, prompt_ids, image_ids=None, data=None):
        if self.cache is not None:
            cond = {key: value.to(self.device) for key, value in self.cache[prompt_ids].items()}
        else:
            cond = self.embed([x[prompt_ids] for x in self.ids])
            if self.zero_rows:
                keep = (prompt_ids != self.zero_rows[0]).to(self.device)
                cond = {key: value * keep.view(-1, *[1] * (value.ndim - 1)) for key, value in cond.items()}
        if self.family.TIME_IDS:
            cond["time_ids"] = data.time_ids(image_ids.tolist()).to(self.device, cond["prompt_embeds"].dtype)
        return cond

    def cached(self):
        """prompt -> its cached conditioning (the validation images' embeddings), or None without a cache."""
        if self.cache is None:
            return None
        return lambda prompt: self.cache[[self.index[prompt]]]

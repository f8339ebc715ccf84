"""torchvision.transforms.functional on a PIL image, as diffusers' example scripts call it: crop, resize, center_crop,
hflip, to_tensor, normalize."""


def crop(image, top, left, height, width):
    return image.crop((left, top, left + width, top + height))


def resize(image, size, interpolation=None):
    """size: (height, width), or an int for the shorter side (the aspect kept)."""
    from PIL import Image

    w, h = image.size
    if isinstance(size, int):
        scale = size / min(w, h)
        target = (max(size, round(w * scale)), max(size, round(h * scale)))
    else:
        target = (size[1], size[0])
    resample = getattr(interpolation, "value", Image.BILINEAR)
    return image if target == (w, h) else image.resize(target, resample)


def center_crop(image, output_size):
    h, w = (output_size, output_size) if isinstance(output_size, int) else tuple(output_size)
    top, left = int(round((image.height - h) / 2.0)), int(round((image.width - w) / 2.0))
    return crop(image, top, left, h, w)


def hflip(image):
    from PIL import Image

    return image.transpose(Image.FLIP_LEFT_RIGHT)


def to_tensor(image):
    """PIL -> float [C, H, W] in [0, 1]."""
    import numpy as np
    import torch

    array = np.asarray(image, dtype=np.float32) / 255.0
    array = array[:, :, None] if array.ndim == 2 else array
    return torch.from_numpy(array.copy()).permute(2, 0, 1)


def normalize(tensor, mean, std):
    import torch

    mean = torch.tensor(mean, dtype=tensor.dtype).view(-1, 1, 1)
    std = torch.tensor(std, dtype=tensor.dtype).view(-1, 1, 1)
    return (tensor - mean) / std

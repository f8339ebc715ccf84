"""--cache_latents: the VAE's latent distribution of every training image, computed once instead of every step."""


class CachedLatents:
    """A dataset over an ImageDataset (center crop): each image's latent-distribution parameters (mean, log-variance;
    latents are still sampled every step), and its mirror image's with random_flip.

    Items {"latent_params", "index"}; the flip of each item is drawn exactly as ImageDataset draws it (same seed,
    epoch and index), so a cached run sees the same data as an uncached one. encode(pixels) -> parameters.
    """

    def __init__(self, images, encode, batch_size):
        import torch

        self.images, r = images, images.resolution
        params = []
        for start in range(0, len(images), batch_size):
            pixels = []
            for i in range(start, min(start + batch_size, len(images))):
                x = images[i]["pixel_values"]
                pixels.append(x.flip(-1) if images.augmentation(i, r, r)[2] else x)  # the unflipped image
            pixels = torch.stack(pixels)
            views = [pixels, pixels.flip(-1)] if images.random_flip else [pixels]
            params.append(torch.stack([encode(v).cpu() for v in views], dim=1))
        self.params = torch.cat(params)  # [N, views, 2 * latent channels, h, w]
        images.cache = None  # the decoded images are not needed any more

    def set_epoch(self, epoch):
        self.images.set_epoch(epoch)

    def __len__(self):
        return len(self.images)

    def views(self, indices):
        """Which view (0: as is, 1: mirrored) each item shows in the current epoch."""
        import torch

        r = self.images.resolution
        if not self.images.random_flip:
            return torch.zeros(len(indices), dtype=torch.long)
        return torch.tensor([int(self.images.augmentation(i, r, r)[2]) for i in indices])

    def __getitem__(self, index):
        return {"latent_params": self.params[index, self.views([index])[0]], "index": index}

    def __getitems__(self, indices):
        """The DataLoader's whole batch (collate_fn=common.image_data.collate_batch): one gather, no dict per item."""
        import torch

        index = torch.as_tensor(indices)
        return {"latent_params": self.params[index, self.views(indices)], "index": index}

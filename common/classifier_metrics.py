"""Score generated images offline with a classifier that train_classifier.py wrote.

Sample accuracy: how often the classifier recognises the class the images were asked for. Fréchet distance: between
the classifier's pooled features of real and of generated images (FID's formula with an offline feature
extractor, so its values compare runs on the same data and classifier, not with published FIDs).
"""
import json
import os

import torch
import torch.nn.functional as F

from .cli import UserError, first_line


class ClassifierScorer:
    def __init__(self, path, device):
        from transformers import AutoModelForImageClassification

        if not os.path.isfile(os.path.join(path, "config.json")):
            raise UserError(f"--eval_classifier '{path}' is not a folder written by train_classifier.py "
                            "(no config.json; run `make train-classifier`)")
        try:
            self.model = AutoModelForImageClassification.from_pretrained(path).to(device).eval()
        except (OSError, ValueError) as err:
            raise UserError(f"--eval_classifier: cannot load an image classifier from '{path}': "
                            f"{first_line(err)}") from None
        processor = {}
        if os.path.isfile(os.path.join(path, "preprocessor_config.json")):
            with open(os.path.join(path, "preprocessor_config.json")) as f:
                processor = json.load(f)
        size = processor.get("size", {})
        side = size.get("shortest_edge", 224)
        self.size = (size.get("height", side), size.get("width", side))
        self.mean = torch.tensor(processor.get("image_mean", [0.5] * 3), device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(processor.get("image_std", [0.5] * 3), device=device).view(1, -1, 1, 1)
        self.device = device
        self.label2id = {str(name): int(i) for i, name in self.model.config.id2label.items()}

    def class_ids(self, names):
        """The classifier's ids for our class names (matched by name)."""
        missing = [name for name in names if name not in self.label2id]
        if missing:
            raise UserError(f"--eval_classifier knows the labels {sorted(self.label2id)[:10]}, "
                            f"not {missing[:5]} of --class_column")
        return torch.tensor([self.label2id[name] for name in names])

    @torch.no_grad()
    def __call__(self, images, batch_size=256):
        """images [N, 3, H, W] in [0, 1] -> (pooled features [N, D] float64, predicted class ids [N]), on the CPU."""
        features, predictions = [], []
        for batch in images.split(batch_size):
            x = F.interpolate(batch.to(self.device), size=self.size, mode="bicubic", align_corners=False).clamp(0, 1)
            out = self.model(pixel_values=(x - self.mean) / self.std, output_hidden_states=True)
            hidden = out.hidden_states[-1]
            features.append((hidden.mean((2, 3)) if hidden.ndim == 4 else hidden[:, 0]).double().cpu())
            predictions.append(out.logits.argmax(-1).cpu())
        return torch.cat(features), torch.cat(predictions)


def macro_f1(predictions, references):
    """Macro-averaged F1 of two 1-D class-id tensors: scikit-learn's f1_score(average="macro"), over the classes
    that occur in either (without importing scikit-learn: a second of start-up)."""
    predictions, references = predictions.long().cpu(), references.long().cpu()
    size = int(max(predictions.max(), references.max())) + 1
    true_positives = torch.bincount(references[predictions == references], minlength=size).double()
    counts = torch.bincount(predictions, minlength=size).double() + torch.bincount(references, minlength=size)
    present = counts > 0
    return float((2 * true_positives[present] / counts[present]).mean())


def frechet_distance(a, b):
    """||mu_a - mu_b||^2 + Tr(S_a + S_b - 2 (S_a S_b)^(1/2)) of two feature sets [N, D], in float64."""
    a, b = a.double(), b.double()
    cov_a, cov_b = torch.cov(a.T), torch.cov(b.T)
    # Tr((S_a S_b)^(1/2)) = sum of sqrt(eigenvalues of S_a^(1/2) S_b S_a^(1/2)), a symmetric PSD matrix.
    values, vectors = torch.linalg.eigh(cov_a)
    root_a = vectors @ torch.diag(values.clamp(min=0).sqrt()) @ vectors.T
    middle = root_a @ cov_b @ root_a
    trace_sqrt = torch.linalg.eigvalsh((middle + middle.T) / 2).clamp(min=0).sqrt().sum()
    return float((a.mean(0) - b.mean(0)).square().sum() + cov_a.trace() + cov_b.trace() - 2 * trace_sqrt)

"""An image+text classifier: pooled image features and pooled text features -> a linear head.

Its three parts (`image_model`, `text_model`, `head`) are the module prefixes `--lr_groups` takes.
Saved as image_model/, text_model/ (from_pretrained folders), head.safetensors and labels.json.
"""
import json
import os

import safetensors.torch
import torch


class ImageTextClassifier(torch.nn.Module):
    def __init__(self, image_model, text_model, id2label):
        super().__init__()
        self.image_model, self.text_model = image_model, text_model
        image_dim = getattr(image_model.config, "hidden_size", None) or image_model.config.hidden_sizes[-1]
        self.head = torch.nn.Linear(image_dim + text_model.config.hidden_size, len(id2label))
        self.id2label = dict(id2label)

    def forward(self, pixel_values, input_ids, attention_mask):
        image = self.image_model(pixel_values=pixel_values).pooler_output.flatten(1)
        text_out = self.text_model(input_ids=input_ids, attention_mask=attention_mask)
        text = text_out.pooler_output if text_out.pooler_output is not None else text_out.last_hidden_state[:, 0]
        return self.head(torch.cat([image, text], dim=-1))

    def save_pretrained(self, path, **kwargs):
        self.image_model.save_pretrained(os.path.join(path, "image_model"))
        self.text_model.save_pretrained(os.path.join(path, "text_model"))
        safetensors.torch.save_model(self.head, os.path.join(path, "head.safetensors"))
        with open(os.path.join(path, "labels.json"), "w") as f:
            json.dump({str(k): v for k, v in self.id2label.items()}, f, indent=2)

    @classmethod
    def from_pretrained(cls, path):
        from transformers import AutoModel

        with open(os.path.join(path, "labels.json")) as f:
            id2label = {int(k): v for k, v in json.load(f).items()}
        model = cls(AutoModel.from_pretrained(os.path.join(path, "image_model")),
                    AutoModel.from_pretrained(os.path.join(path, "text_model")), id2label)
        safetensors.torch.load_model(model.head, os.path.join(path, "head.safetensors"))
        return model

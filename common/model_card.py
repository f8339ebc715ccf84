"""A README.md model card beside a model the recipes write."""
import os


def write_model_card(output_dir, title, summary, facts, usage, images=()):
    """facts: {label: value} listed as bullets; usage: a code block; images: paths relative to output_dir."""
    lines = [f"# {title}", "", summary, ""]
    lines += [f"- **{key}**: {value}" for key, value in facts.items()]
    lines += ["", "## Use it", "", "```python", usage.strip(), "```", ""]
    lines += [f"![{os.path.basename(path)}]({path})" for path in images]
    with open(os.path.join(output_dir, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")

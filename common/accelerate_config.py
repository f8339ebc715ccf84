"""`python -m common.accelerate_config FILE`: check an accelerate yaml before `accelerate launch` reads it.

accelerate answers an unreadable file with a traceback; the Makefile runs this first so the user gets one line.
Only the YAML is checked here (fast, no torch import); accelerate validates the values itself.
"""
import os
import sys


def check(path):
    """-> None when `path` is a readable YAML mapping, else the reason in one line."""
    import yaml

    if not os.path.isfile(path):
        return f"accelerate config '{path}' does not exist (see accelerate_configs/)"
    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as err:
        return f"accelerate config '{path}' cannot be read: {' '.join(str(err).split())[:300]}"
    if not isinstance(config, dict) or "distributed_type" not in config:
        return f"accelerate config '{path}' is not an accelerate config (no distributed_type); see accelerate_configs/"
    return None


if __name__ == "__main__":
    problem = check(sys.argv[1])
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)

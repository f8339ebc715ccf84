"""Run one of diffusers' example scripts (argv[1], with the rest of argv as its flags) with
tests/benchmarks/peer_torchvision standing in for torchvision, which does not import beside this project's CPU torch.
transformers and diffusers are imported first, so that they see no torchvision (and use their PIL paths, as they do in
the recipes); only the script's own `from torchvision import transforms` gets the stand-in."""
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__":
    import diffusers  # noqa: F401
    import transformers  # noqa: F401

    sys.path.insert(0, HERE)
    import peer_torchvision
    import peer_torchvision.transforms
    import peer_torchvision.transforms.functional

    sys.modules.update({"torchvision": peer_torchvision, "torchvision.transforms": peer_torchvision.transforms,
                        "torchvision.transforms.functional": peer_torchvision.transforms.functional})
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
